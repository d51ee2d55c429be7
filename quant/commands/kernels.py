"""`quant kernels status|build`: the ahead-of-time compiled CPU kernels in the cache."""

from __future__ import annotations

import subprocess
import time
import warnings

import typer

app = typer.Typer(help="Ahead-of-time compiled CPU kernels (built once per machine, loaded in milliseconds).",
                  no_args_is_help=True)


def _kernels():
    import quant.numerics.fp8  # noqa: F401  (registers its kernels)
    import quant.numerics.mxfp4  # noqa: F401
    from quant.numerics._compile import Kernel

    return [k for k in Kernel.registry if k.examples]


@app.command("status")
def status() -> None:
    """List each kernel signature and whether its package is built."""
    from quant.numerics._aot import cache_dir, package_path, signature

    missing = 0
    for k in _kernels():
        for args in k.examples():
            path = package_path(k.eager, k.name, signature(args))
            missing += not path.is_file()
            typer.echo(f"{'built  ' if path.is_file() else 'missing'}  {k.name}({signature(args)})")
    from quant.numerics import _native

    if _native._isa() is not None:
        path = _native.library_path()
        missing += not path.is_file()
        typer.echo(f"{'built  ' if path.is_file() else 'missing'}  native MXFP4/FP8 kernels ({path.name})")
    typer.echo(f"cache: {cache_dir()}" + (f"; {missing} missing: run `quant kernels build`" if missing else ""))


@app.command("build")
def build(force: bool = typer.Option(False, help="Rebuild packages that already exist")) -> None:
    """Compile every kernel for this machine (about 10 s each, once; later runs skip built ones). On AVX-512
    machines each kernel is built with 512- and 256-bit vectors and the faster one on this machine is kept."""

    from quant.numerics._aot import package_simdlen

    warnings.filterwarnings("ignore")  # export's deprecation chatter is not the user's concern
    built = 0
    for k in _kernels():
        start = time.perf_counter()
        for path, new in k.build_aot(force=force):
            built += new
            typer.echo(f"{'built' if new else 'up to date'}: {path.name}"
                       + (f" ({time.perf_counter() - start:.1f} s, vectors {package_simdlen(path)})" if new else ""),
                       err=True)
            start = time.perf_counter()
    from quant.numerics import _native

    start = time.perf_counter()
    try:
        native = _native.build(force=force)
    except (OSError, subprocess.CalledProcessError) as e:  # no working C++ compiler: the torch kernels remain
        typer.echo(f"native kernels not built ({getattr(e, 'stderr', '') or e}); the torch kernels are used", err=True)
        native = None
    if native is not None:
        path, new = native
        built += new
        typer.echo(f"{'built' if new else 'up to date'}: {path.name}"
                   + (f" ({time.perf_counter() - start:.1f} s)" if new else ""), err=True)
    typer.echo(f"{built} kernel package(s) built", err=True)
