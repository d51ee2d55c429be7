"""The `quant` command. Each subcommand lives in its own module; heavy imports (torch, transformers)
happen inside the commands so `quant --help` stays instant."""

from __future__ import annotations

import sys

import typer

from quant.errors import QuantError

app = typer.Typer(
    name="quant",
    help="MXFP4/FP8 quantization and accuracy validation for MoE checkpoints (Quark format for SGLang/vLLM).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    from evals import command as eval_cmd
    from quant.commands import demo, quantize, toy, verify

    app.command("toy")(toy.command)
    app.command("quantize")(quantize.command)
    app.command("verify-manifest")(verify.command)
    app.command("eval")(eval_cmd.command)
    app.command("demo")(demo.command)


_register()


def main() -> None:
    try:
        app()
    except QuantError as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        typer.secho("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
