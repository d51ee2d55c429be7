"""`quant search SRC (--max-size SIZE | --bits B) --out RECIPE.yaml`: the mix of formats with the least measured
loss within a budget, written as a user recipe for `quant quantize --recipe`. `quant search SRC --dry-run`: what
the streamed Fisher estimate would cost (memory, FLOPs, bytes read), from config.json alone (quant.search.cost)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from quant.errors import QuantError
from quant.gptq.calibration import DEFAULT_DATA, CalibrationSettings


def command(
    src: Path = typer.Argument(..., metavar="SRC", help="A BF16 source checkpoint directory."),
    out: Path = typer.Option(None, "--out", help="The recipe file to write (refused if it exists, without "
                             "--overwrite; not with --dry-run)."),
    max_size: str = typer.Option(None, "--max-size", help="Budget: the export's shard bytes (e.g. 950KB, 80GB)."),
    bits: float = typer.Option(None, "--bits", help="Budget: effective bits per parameter of the linears."),
    engine: list[str] = typer.Option(None, "--engine", "-e", help="Only formats these releases load (sglang, "
                                     "vllm==0.33, ...; repeatable; default: the serving engines)."),
    calib_data: str = typer.Option(None, "--calib-data", help="Calibration text: a local .txt/.jsonl file or a hub "
                                   "dataset (default: GPTQ's)."),
    calib_samples: int = typer.Option(32, "--calib-samples", help="Calibration windows."),
    calib_seq_len: int = typer.Option(128, "--calib-seq-len", help="Tokens per window."),
    sensitivity: str = typer.Option("fisher", "--sensitivity", help="fisher: estimated streaming one decoder layer "
                                    "at a time (any size); kl: measured exactly on the whole model in memory."),
    plot: Path = typer.Option(None, "--plot", help="Also draw the Pareto front, the uniform recipes and the pick "
                              "as a PNG (refused if it exists, without --overwrite)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out file."),
    as_json: bool = typer.Option(False, "--json", help="Print the pick (with --dry-run: the prediction) as JSON."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print, from SRC's config.json alone (no weights read, "
                                 "nothing written), what the Fisher estimate would cost: memory, layer passes, "
                                 "FLOPs and bytes read, per kind of decoder layer and in total."),
) -> None:
    """Pick each unit's format (engine-loadable by construction) to minimise the measured damage (KL) in a budget."""
    if dry_run:
        _dry_run(src, engine or None, calib_samples, calib_seq_len, as_json)
        return
    from quant.search.run import search
    from quant.units import parse_size

    if out is None:
        raise QuantError("give --out RECIPE.yaml (the recipe to write), or --dry-run")
    if (max_size is None) == (bits is None):
        raise QuantError("give one budget: --max-size SIZE or --bits B")
    if bits is not None and not 1 <= bits <= 16:
        raise QuantError(f"--bits {bits}: must be between 1 and 16")
    for path in (out, plot):
        if path is not None and path.exists() and not overwrite:
            raise QuantError(f"{path} exists; pass --overwrite to replace it")
    limit = parse_size(max_size, "--max-size") if max_size is not None else None
    calib = CalibrationSettings(calib_data or DEFAULT_DATA, calib_samples, calib_seq_len)
    log = (lambda _m: None) if as_json else typer.echo
    result = search(src, engine or None, calib, max_size=limit, bits=bits, log=log, sensitivity=sensitivity)
    out.write_text(result["recipe_yaml"])
    if plot is not None:
        from quant.search.plot import plot_front

        plot_front(result["front"], result, plot, f"quant search {src.name}: {result['size_bytes']} bytes")
    if as_json:
        typer.echo(json.dumps({k: v for k, v in result.items() if k != "recipe_yaml"}, indent=1))
        return
    for row in result["front"]:
        typer.echo(f"  {row['size_bytes']:>14} bytes  {row['effective_bits']:7.4f} bits  {row['predicted_loss']:+.5f}"
                   f"  {row['what']}")
    typer.echo(f"wrote {out}: {result['size_bytes']} bytes, {result['effective_bits']} effective bits, predicted "
               f"NLL {result['predicted_loss']:+.5f} (quant quantize SRC OUT --recipe {out})")


def _dry_run(src: Path, engines: list[str] | None, samples: int, seq_len: int, as_json: bool) -> None:
    from quant.search.cost import render, search_cost

    cost = search_cost(src, samples=samples, seq_len=seq_len, engines=engines)
    if as_json:
        typer.echo(json.dumps(cost.as_dict(), indent=1))
        return
    for line in render(cost):
        typer.echo(line)
