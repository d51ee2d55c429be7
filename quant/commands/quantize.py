"""`quant quantize SRC OUT`."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from quant.errors import QuantError
from quant.gptq.calibration import DEFAULT_DATA
from quant.planning.recipes import recipe_names
from quant.planning.schemes import ALIASES, DEFAULT_SCHEME, OTHER_MEANINGS, SCHEMES
from quant.process import reuse_freed_memory

# The lists in --help come from the data (manifests/recipes.yaml, the scheme table): tests/test_docs_from_data.py.
RECIPES_HELP = " | ".join([f"{recipe_names()[0]} (default)", *recipe_names()[1:],
                           "a YAML file {base, roles, keep, mtp_layer}"])
SCHEMES_HELP = " | ".join(SCHEMES)
ALIASES_HELP = (", ".join(f"{alias} = {target} ({who})" for alias, (target, who) in ALIASES.items())
                + f"; refused with what to write instead: {', '.join(OTHER_MEANINGS)} (fp8 here is per-channel "
                  "weights with dynamic per-token activations, not Quark's or llm-compressor's per-tensor FP8)")


def command(
    src: str = typer.Argument(..., help="Source checkpoint: a local directory or a Hugging Face hub id."),
    out: Path = typer.Argument(..., help="Output directory (new, empty, or an interrupted earlier run to resume)."),
    scheme: str = typer.Option(DEFAULT_SCHEME, help=f"{SCHEMES_HELP}. The peers' names: {ALIASES_HELP}"),
    recipe: Optional[str] = typer.Option(None, help=RECIPES_HELP),
    scale_mode: str = typer.Option("even", help="MXFP4 scale rule: even | floor | rceil | search"),
    devices: str = typer.Option("auto", help="auto (one worker per visible GPU, else CPU workers) or "
                                "comma-separated torch devices, one worker each, e.g. cuda:0,cuda:1 or cpu"),
    workers: int = typer.Option(1, help="CPU workers when no GPU is used"),
    check_engines: str = typer.Option(
        "auto",
        help="Engine releases the self-check must pass for: auto (the newest release of each engine that loads "
             "the scheme), '' to skip, 'sglang' (its default releases), 'vllm==0.32' (one release). "
             "`quant verify-manifest` checks every default release."),
    progress: bool = typer.Option(True, help="Show a progress bar"),
    method: str = typer.Option("rtn", help="rtn (round to nearest) | gptq (error-aware rounding, calibrated layer "
                               "by layer; MXFP4 schemes; same output format)"),
    calib_data: str = typer.Option(DEFAULT_DATA,
                                   help="GPTQ calibration text: a local .txt/.jsonl/.json/.parquet file, or a "
                                   "Hugging Face dataset ID[:CONFIG[:SPLIT]]"),
    calib_samples: int = typer.Option(128, help="GPTQ: calibration windows"),
    calib_seq_len: int = typer.Option(2048, help="GPTQ: tokens per calibration window"),
    calib_seed: int = typer.Option(0, help="GPTQ: seed of the windows' offsets"),
    damp: float = typer.Option(0.01, help="GPTQ: damping, relative to the mean diagonal of each Hessian"),
    hessian_budget: str = typer.Option("4GiB", help="GPTQ: the most fp32 expert Hessians one calibration pass "
                                       "holds (e.g. 4GiB, 40GB); a layer's experts beyond it take more passes "
                                       "over the calibration windows (same output, more time)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print, from SRC's config.json alone, the predicted peak "
                                 "memory per device and the calibration passes per layer of this run; reads no "
                                 "weights and neither creates nor touches OUT"),
    device_memory: Optional[str] = typer.Option(None, help="--dry-run: the memory of each named accelerator "
                                                "(e.g. 80GB) when it is not on this machine"),
    max_disk: Optional[str] = typer.Option(None, help="A Hub source: the most disk its streamed shards may take at "
                                           "once (e.g. 200GB, 1.5TiB); refused at start when the largest shards "
                                           "one step holds and the look-ahead cannot fit. Default: no limit"),
    look_ahead: int = typer.Option(1, help="A Hub source: shards fetched ahead of the one being quantized"),
    stream: bool = typer.Option(True, help="A Hub source: fetch each shard when it is needed and delete it once "
                                "its output is written (--no-stream: download the whole repository first)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an earlier export of another source or "
                                   "other settings in OUT, or write into a directory this tool did not make; "
                                   "files this tool did not write are never deleted"),
    ranks: int = typer.Option(1, help="GPTQ: run as N torch.distributed ranks on this machine, one process per "
                              "device (GPU i, else CPU); across machines run `torchrun ... -m quant quantize` "
                              "instead (README). Same bytes as one process"),
) -> None:
    """Quantize a checkpoint to MXFP4/FP8, streaming shard to shard, and check that the engines will load it."""
    from quant.gptq.ranks import launched
    from quant.units import parse_size

    if ranks != 1 and not dry_run and not launched():
        _launch_ranks(ranks, method, devices, workers)
        return
    budget = parse_size(hessian_budget, "--hessian-budget")
    # GPTQ's settings, once: the dry run sizes them, the run solves with them (round to nearest has none).
    gptq = _gptq_settings(calib_data, calib_samples, calib_seq_len, calib_seed, damp, budget) \
        if dry_run or method == "gptq" else None
    if dry_run:
        _dry_run(src, method=method, scheme=scheme, recipe=recipe, devices=devices, workers=workers, gptq=gptq,
                 device_memory=device_memory, ranks=ranks)
        return
    _quantize(src, out, devices=devices, workers=workers, gptq=gptq, check_engines=check_engines,
              max_disk=parse_size(max_disk, "--max-disk") if max_disk else None,
              options=dict(scheme=scheme, recipe=recipe, scale_mode=scale_mode, progress=progress, method=method,
                           overwrite=overwrite, stream=None if stream else False, look_ahead=look_ahead))


def _launch_ranks(ranks: int, method: str, devices: str, workers: int) -> None:
    """`--ranks N` outside torchrun: start N ranks of this same command on this machine and wait for them."""

    from quant.gptq.ranks import launch_local

    if method != "gptq":
        from quant.errors import QuantError

        raise QuantError(f"--ranks {ranks}: ranks share GPTQ's work; --method {method} has none to share")
    _one_device_per_rank(devices, workers)
    code = launch_local(ranks, sys.argv)
    if code:
        raise typer.Exit(code)


def _dry_run(src: str, *, method: str, scheme: str, recipe, devices: str, workers: int, gptq, device_memory,
             ranks: int) -> None:
    from quant.gptq.dry_run import predict
    from quant.gptq.ranks import launched
    from quant.units import parse_size

    if launched() and os.environ.get("RANK", "0") != "0":
        return  # under torchrun: rank 0 prints it
    memory = parse_size(device_memory, "--device-memory") if device_memory else None
    typer.echo(predict(src, method=method, scheme=scheme, recipe=recipe, devices=devices, workers=workers,
                       settings=gptq, device_memory=memory, ranks=ranks).text())


def _quantize(src: str, out: Path, *, devices: str, workers: int, gptq, check_engines: str, max_disk,
              options: dict) -> None:
    """The run itself (on rank 0 when launched as several ranks), then its summary lines."""
    from quant.gptq.ranks import launched
    from quant.pipeline import quantize_checkpoint

    reuse_freed_memory()
    engines = "auto" if check_engines.strip() == "auto" else [e for e in check_engines.split(",") if e.strip()]
    manifest = None

    def run(devices=devices, gptq=gptq):
        nonlocal manifest
        try:
            manifest = quantize_checkpoint(src, out, devices=devices, workers=workers, check_engines=engines,
                                           gptq=gptq, log=lambda m: typer.echo(m, err=True), max_disk=max_disk,
                                           **options)
        except OSError as e:  # a write that names no file (a full disk met mid-write): OUT is the path to name
            from quant.errors import naming

            raise naming(e, out) from None

    if launched():  # one of several torch.distributed ranks (torchrun, or --ranks)
        _run_ranked(run, devices, workers, gptq)
        if manifest is None:  # not rank 0
            return
    else:
        run()
    timing = manifest["timing"]
    typer.echo("time: " + ", ".join(f"{k[:-2]} {v:.2f}s" for k, v in timing.items() if k.endswith("_s"))
               + (f"; scales read before the first byte: {timing['scale_scan_tensors']} tensors, "
                  f"{timing['scale_scan_bytes'] / 1e6:.2f} MB" if timing.get("scale_scan_tensors") else ""), err=True)
    if "stream" in manifest:
        typer.echo(_stream_line(manifest["stream"]), err=True)
    typer.echo(_wrote_line(out, manifest))


def _run_ranked(run, devices: str, workers: int, gptq) -> None:
    """This process is one of several ranks: rank 0 runs the pipeline on its device, its GPTQ solver sharing the
    work with the others (`quant.gptq.ranks`); the others follow it."""

    from quant.gptq.ranks import Ranks, run_command
    from quant.gptq.run import solve_checkpoint

    if os.environ.get("RANK", "0") != "0" and (devices != "auto" or workers != 1):
        raise typer.Exit(QuantError.exit_code)  # rank 0 says why
    _one_device_per_rank(devices, workers)
    ranks = Ranks.from_env()
    mine = dataclasses.replace(gptq, ranks=ranks) if gptq is not None else None
    run_command(ranks, lambda: run(devices=ranks.device, gptq=mine), solve_checkpoint)


def _one_device_per_rank(devices: str, workers: int) -> None:
    if devices != "auto" or workers != 1:
        raise QuantError("under torchrun (or --ranks) each rank computes on its own device (GPU LOCAL_RANK, else "
                         "the CPU): leave --devices auto and --workers 1")


def _stream_line(stream: dict) -> str:
    """What streaming from the Hub did: bytes fetched and their rate, shards kept from an earlier run, peak disk."""
    rate = stream["fetched_bytes"] / stream["fetch_s"] / 1e6 if stream["fetch_s"] else 0.0
    from quant.units import decimal

    limit = f" (--max-disk {decimal(stream['budget_bytes'])})" if stream["budget_bytes"] else ""
    return (f"hub: fetched {stream['fetched_files']} source file(s), {decimal(stream['fetched_bytes'])} at "
            f"{rate:.1f} MB/s, {stream['kept_files']} kept from an earlier run; peak source on disk "
            f"{decimal(stream['peak_disk_bytes'])}{limit}")


def _gptq_settings(data: str, samples: int, seq_len: int, seed: int, damp: float, hessian_bytes: int):
    from quant.gptq import CalibrationSettings, GptqSettings

    return GptqSettings(CalibrationSettings(data, samples, seq_len, seed), damp=damp, hessian_bytes=hessian_bytes)


def _wrote_line(out: Path, manifest: dict) -> str:
    """The export in one line: its size, modules per treatment, exclude entries and the worst error."""
    from quant.pipeline.run import ExportSummary

    summary = ExportSummary.of_manifest(manifest)
    treat = ", ".join(f"{k}: {v}" for k, v in sorted(summary.modules_by_treatment.items()))
    worst = summary.worst
    return (f"wrote {out} ({summary.output_bytes / 1e6:.1f} MB; {treat}; "
            f"{len(manifest['exclude'] or [])} exclude entries"
            + (f"; worst relative MSE {worst.rel_mse:.3%} in {worst.module}" if worst else "") + ")")
