"""The `quant` command. Each subcommand lives in its own module; heavy imports (torch, transformers)
happen inside the commands so `quant --help` stays instant."""

from __future__ import annotations

import os
import signal
import traceback
from importlib.metadata import PackageNotFoundError, version

import typer

from quant.errors import QuantError, machine_failure
from quant.process import bars_off_a_terminal, exit_now, supervise

app = typer.Typer(
    name="quant",
    help="MXFP4/FP8 quantization and accuracy validation for MoE checkpoints (Quark format for SGLang/vLLM).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # click's own help layout: wrapped to the terminal (COLUMNS honoured), never a default cut with an ellipsis
    rich_markup_mode=None,
)

# An unexpected exception (a bug, not the input): distinct from 1 ("an engine would fail") and 2 ("unreadable").
INTERNAL_ERROR = 70
INTERRUPTED = 130  # 128 + SIGINT, as shells report it
IO_ERROR = 74  # sysexits EX_IOERR: the machine failed us (disk full, read-only, permission), not the input


def _version(value: bool) -> None:
    if value:
        from quant import __version__

        try:
            installed = version("moe-quant")
        except PackageNotFoundError:
            installed = __version__
        typer.echo(f"moe-quant {installed}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """MXFP4/FP8 quantization and accuracy validation for MoE checkpoints (Quark format for SGLang/vLLM)."""


def _register() -> None:
    from evals import command as eval_cmd
    from quant.commands import demo, engines, kernels, push, quantize, search, toy, verify

    app.command("toy")(toy.command)
    app.command("quantize")(quantize.command)
    app.command("verify-manifest")(verify.command)
    app.command("push")(push.command)
    app.command("search")(search.command)
    app.command("eval")(eval_cmd.command)
    app.command("demo")(demo.command)
    app.add_typer(kernels.app, name="kernels")
    app.add_typer(engines.app, name="engines")


_register()


def conventional(command):
    """The command tree with the metavars users of argparse and click tools read: `quant quantize [OPTIONS] SRC OUT`,
    `--scheme SCHEME`, `--workers N`, a flag with none (typer would show `{src}` and `<str>`)."""
    from typer.core import TyperArgument

    for sub in getattr(command, "commands", {}).values():
        conventional(sub)
    for param in command.params:
        if param.metavar is not None:
            continue
        annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
        if isinstance(param, TyperArgument):
            # typer 0.29 prints a required argument as `{NAME}` with its `<type>`: the instance's own methods win
            name = param.metavar = param.name.upper()
            param._usage_display_name = (lambda n: (lambda: n))(name if param.required else f"[{name}]")
            param.display_type_rich = lambda ctx: None
        elif getattr(param, "is_flag", False) or annotation is bool:
            param.metavar = ""
        else:
            param.metavar = {int: "N", float: "X"}.get(annotation) or param.name.upper()
    return command


def main() -> None:
    # The command runs in a child process whose native crash becomes one line and exit 70 (quant.process.supervise)
    supervised = supervise()
    if supervised is not None:
        exit_now(supervised)
    # Output piped into `head` and the like: die quietly of SIGPIPE as Unix tools do (exit 141 in the shell),
    # instead of a traceback or a misleading exit code from the next write to a closed pipe.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    bars_off_a_terminal()
    try:
        conventional(typer.main.get_command(app))(prog_name="quant")
        code = 0
    except SystemExit as e:
        code = e.code
        if code == INTERRUPTED:  # typer turns Ctrl-C into a silent exit 130
            _interrupted()
    except QuantError as e:
        _error(str(e))
        code = e.exit_code
    except KeyboardInterrupt:
        _interrupted()
        code = INTERRUPTED
    except OSError as e:  # read-only output, disk full, permission: the path and the system's reason
        _error(os_error_line(e))
        code = IO_ERROR
    except Exception as e:
        machine = machine_failure(e)
        if machine is not None:  # a full disk or a read-only one met inside a library (lm-eval, datasets, ...)
            _error(os_error_line(machine))
            code = IO_ERROR
        else:  # a bug of ours: one line and its own exit code, never read as a verdict
            if os.environ.get("QUANT_DEBUG"):
                traceback.print_exc()
            first = (str(e).splitlines() or [""])[0][:300]
            _error(f"internal error ({type(e).__name__}: {first}); please report it (QUANT_DEBUG=1 prints the "
                   f"traceback)")
            code = INTERNAL_ERROR
    exit_now(code)


def _error(message: str) -> None:
    """One line on stderr; a path that is not valid UTF-8 is shown with its bytes escaped, never a crash."""
    text = message.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    typer.secho(f"error: {text}", fg=typer.colors.RED, err=True)


def _interrupted() -> None:
    typer.secho("error: interrupted; nothing unfinished was published (quantize: the same command resumes from "
                "the finished shards; eval: no report was written)", fg=typer.colors.RED, err=True)


def os_error_line(e: OSError) -> str:
    """`PATH: reason` of an OSError (the path it names, else its message)."""
    reason = e.strerror or " ".join(str(e).split())
    return f"{os.fsdecode(e.filename)}: {reason}" if e.filename is not None else reason


if __name__ == "__main__":
    main()
