"""`quant verify-manifest CKPT`: predict SGLang / vLLM / transformers load failures from headers alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer


def command(
    ckpt: Path = typer.Argument(..., help="Quark checkpoint directory (config.json + safetensors shards), or a "
                                          "Hub model ORG/NAME[@REVISION]: its config, index and shard headers are "
                                          "read over HTTP, never the weights (HF_TOKEN for private or gated ones)."),
    engine: Optional[List[str]] = typer.Option(None, "--engine", "-e",
                                     help="sglang | vllm | transformers | all, or one release: sglang==0.5.12 "
                                          "(repeatable; default: the serving engines sglang and vllm, each at its "
                                          "default releases, strictest rules; transformers' own Quark loading "
                                          "only with transformers or all)."),
    json_out: bool = typer.Option(False, "--json", help="Print the findings as JSON."),
    fix: Optional[Path] = typer.Option(None, "--fix", help="Write a corrected config.json to this path (a new "
                                       "file; never over the checkpoint's own, nor over an existing file unless "
                                       "--overwrite)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Let --fix replace an existing file."),
    tp: Optional[int] = typer.Option(None, "--tp", min=1, help="Tensor-parallel degree to check MX splits for."),
    scales: bool = typer.Option(False, "--scales",
                                help="Also read every scale tensor (never the weights; about 1/17 of an MXFP4 "
                                     "checkpoint): E8M0 scales of 0x00 / 0xFF, FP8 scales of zero, inf or NaN."),
) -> None:
    """Header-only preflight of a Quark checkpoint: exit 0 when no engine is predicted to fail, 1 on errors,
    2 when the checkpoint cannot be read. With --scales the scale values are checked too."""
    from rich.console import Console

    from quant.hub import hub_reference, open_hub_checkpoint
    from quant.verify import fix_config, verify_checkpoint

    if fix is not None:
        check_fix_target(ckpt, fix, overwrite)  # before any work
    ref = hub_reference(ckpt)  # ORG/NAME[@REVISION] that is no local path: read over HTTP, never the weights
    hub = open_hub_checkpoint(ref) if ref is not None else None
    try:
        report = verify_checkpoint(hub or ckpt, engines=list(engine or []) or None, tp=tp)
        scanned = None
        if scales:
            from quant.verify.scales import ScanStats, scan_scales

            scanned = ScanStats()
            report.findings += scan_scales(hub or ckpt, stats=scanned)
        fixed = fix_config(hub or ckpt, fix) if fix is not None else None
    finally:
        if hub is not None:
            hub.close()
    if json_out:
        data = report.to_json()
        if hub is not None:
            data["hub"] = hub.summary()
        if fixed is not None:
            data["fixed_config"] = str(fixed)
        if scanned is not None:
            data["scales"] = {"tensors": scanned.tensors, "bytes": scanned.bytes, "shards": scanned.files}
        typer.echo(json.dumps(data, indent=2))
    else:
        console = Console()  # the terminal's width (COLUMNS honoured); records off a terminal
        from quant.verify.report import render

        render(report, console)
        if scanned is not None:
            console.print(f"scales: read {scanned.tensors} scale tensors ({scanned.bytes / 1e6:.3g} MB) from "
                          f"{scanned.files} shard(s)")
        if fixed is not None:
            console.print(f"wrote corrected config to {fixed} (re-run verify-manifest on a copy using it)")
        if hub is not None:
            console.print(hub.traffic_line())
    raise typer.Exit(report.exit_code)


def check_fix_target(ckpt: Path, fix: Path, overwrite: bool) -> None:
    """`--fix PATH` writes one new file, never inside the checkpoint it verifies (quant.ownership.check_new_file)."""
    from quant.ownership import check_new_file

    check_new_file(fix, "--fix", {"checkpoint": ckpt}, overwrite)
