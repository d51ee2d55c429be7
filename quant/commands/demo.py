"""`quant demo OUT`: the whole pipeline on built-in toys.

build → quantize (FP8 baseline and MXFP4) → verify-manifest → eval → report. It uses the trained toy
(evals/data/toy_arith/model, shipped in the package: a glm5-layout MoE with its MTP layer that does small arithmetic in GSM8K format)
for the accuracy comparison, and a freshly built glm5 toy to show the preflight on a full-size layout.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import typer

from evals.tasks import EVAL_DATA_DIR

TRAINED_TOY = EVAL_DATA_DIR / "toy_arith" / "model"


def _step(title: str) -> None:
    typer.secho(f"\n== {title}", bold=True)


def command(
    out: Path = typer.Argument(Path("demo-out"), help="Directory for everything the demo writes (replaced)."),
    limit: int = typer.Option(200, help="Questions per arm in the eval step (the toy test set has 200; with no "
                              "discordant answer a 2-point margin needs at least 189 to decide)."),
) -> None:
    """Run build → quantize → verify-manifest → eval → report on toy models."""
    from evals.compare import EvalRequest, evaluate
    from evals.report import print_table
    from quant.pipeline import quantize_checkpoint
    from quant.toy import build_toy
    from quant.verify import verify_checkpoint
    from quant.verify.report import render
    from rich.console import Console

    console = Console()

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    _step("1. build a toy GLM-5 (glm_moe_dsa, routed + shared experts, DSA indexer, MTP layer)")
    toy = build_toy("glm5", out / "toy-glm5", shard_size=2_000_000)
    typer.echo(f"   {toy}")

    _step("2. quantize the toy to MXFP4 (experts) and check it with the preflight for every engine")
    quantize_checkpoint(toy, out / "toy-glm5-mxfp4", progress=True)
    render(verify_checkpoint(out / "toy-glm5-mxfp4", engines=["all"]), console)

    _step("3. quantize the trained toy: block-FP8 baseline and MXFP4 candidate")
    # The trained toy's experts are 64 wide, below the 128 block vLLM's and SGLang's block-FP8 FusedMoE need (the
    # preflight says so); the baseline is only evaluated in-process here, so it is checked for transformers.
    quantize_checkpoint(TRAINED_TOY, out / "arith-fp8", scheme="fp8-block", recipe="all-linear",
                        check_engines=["transformers"], progress=True)
    quantize_checkpoint(TRAINED_TOY, out / "arith-mxfp4", progress=True)
    render(verify_checkpoint(out / "arith-mxfp4", engines=["all"]), console)

    _step("4. evaluate both in-process with lm-eval and compare them question by question")
    report = evaluate(EvalRequest(candidate=str(out / "arith-mxfp4"), baseline=str(out / "arith-fp8"),
                                  tasks="toy_arith", limit=limit, out=out / "report", dtype="float32"),
                      log=lambda m: typer.echo(f"   {m}"))
    print_table(report)
    typer.echo(f"\nreport: {out / 'report' / 'report.md'} (+ report.json, report.png); verdict: {report['verdict']}")
