"""`quant demo OUT`: the whole pipeline on built-in toys.

build → quantize (FP8 baseline and MXFP4) → verify-manifest → eval → report. It uses the trained toy
(evals/data/toy_arith/model, shipped in the package: a glm5-layout MoE with its MTP layer that does small arithmetic
in GSM8K format) for the accuracy comparison, and a freshly built glm5 toy to show the preflight on a full-size layout.
"""

from __future__ import annotations

from pathlib import Path

import typer

from evals.tasks.data_sources import EVAL_DATA_DIR
from quant.commands.toy import write_toy
from quant.errors import QuantError

TRAINED_TOY = EVAL_DATA_DIR / "toy_arith" / "model"


def _step(title: str) -> None:
    typer.secho(f"\n== {title}", bold=True)


def command(
    out: Path = typer.Argument(Path("demo-out"), help="Directory for everything the demo writes: new, empty, or "
                               "an earlier demo's (its outputs are brought up to date)."),
    limit: int = typer.Option(200, help="Questions per arm in the eval step (the toy test set has 200; with no "
                              "discordant answer a 2-point margin needs at least 189 to decide)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Write into a directory this tool did not make "
                                   "(files it did not write are never deleted)."),
) -> None:
    """Run build → quantize → verify-manifest → eval → report on toy models. Exits as `quant eval` does on its
    verdict: 0 pass, 1 fail, 3 inconclusive (a --limit too small to decide), 4 invalid."""
    from quant.ownership import claim

    if not 1 <= limit <= 200:
        raise QuantError(f"--limit {limit}: the toy test set has 200 questions; give 1 to 200")
    with claim(out, "demo", overwrite=overwrite, what="demo") as held:
        held.add_dirs(["toy-glm5", "toy-glm5-mxfp4", "arith-fp8", "arith-mxfp4", "report"])
        code = _demo(held.root, limit, overwrite)
    raise typer.Exit(code)


def _demo(out: Path, limit: int, overwrite: bool) -> int:
    """The demo's steps; the eval's exit code (the README's table)."""
    from rich.console import Console

    from evals.compare import EvalRequest, evaluate
    from evals.report.card import add_accuracy
    from evals.report.render import print_table
    from quant.pipeline import quantize_checkpoint
    from quant.verify import verify_checkpoint
    from quant.verify.report import render

    console = Console()

    _step("1. build a toy GLM-5 (glm_moe_dsa, routed + shared experts, DSA indexer, MTP layer)")
    toy = write_toy("glm5", out / "toy-glm5", shard_size=2_000_000, overwrite=overwrite)
    typer.echo(f"   {toy}")

    _step("2. quantize the toy to MXFP4 (experts) and check it with the preflight for every engine")
    quantize_checkpoint(toy, out / "toy-glm5-mxfp4", progress=True, overwrite=overwrite)
    render(verify_checkpoint(out / "toy-glm5-mxfp4", engines=["sglang", "vllm"]), console)

    _step("3. quantize the trained toy: block-FP8 baseline and MXFP4 candidate")
    # The trained toy's experts are 64 wide, below the 128 block vLLM's and SGLang's block-FP8 FusedMoE need (the
    # preflight says so); the baseline is only evaluated in-process here, so it is checked for transformers.
    quantize_checkpoint(TRAINED_TOY, out / "arith-fp8", scheme="fp8-block", recipe="all-linear",
                        check_engines=["transformers"], progress=True, overwrite=overwrite)
    quantize_checkpoint(TRAINED_TOY, out / "arith-mxfp4", progress=True, overwrite=overwrite)
    render(verify_checkpoint(out / "arith-mxfp4", engines=["sglang", "vllm"]), console)

    _step("4. evaluate both in-process with lm-eval and compare them question by question")
    # float64: greedy answers that do not follow the CPU's vector ISA or BLAS (in float32 the same demo scored the
    # baseline 95.0% under AVX2 and 96.5% under AVX-512), so the README's figures are what every machine prints
    report = evaluate(EvalRequest(candidate=str(out / "arith-mxfp4"), baseline=str(out / "arith-fp8"),
                                  tasks="toy_arith", limit=limit, out=out / "report", dtype="float64",
                                  overwrite=overwrite),
                      log=lambda m: typer.echo(f"   {m}"))
    print_table(report)
    typer.echo(f"   model card: {add_accuracy(out / 'arith-mxfp4', report.to_json(), out / 'report')}")
    typer.echo(f"\nreport: {out / 'report' / 'report.md'} (+ report.json, report.png); verdict: "
               f"{report.verdict.value} (exit {report.exit_code})")
    return report.exit_code
