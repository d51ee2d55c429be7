"""`quant search SRC (--max-size SIZE | --bits B) --out RECIPE.yaml`: the mix of formats with the least measured
loss within a budget, written as a user recipe for `quant quantize --recipe`. With `--min-recovery R --baseline
BASE --tasks T`: the smallest mix whose `quant eval` against BASE passes (quant/commands/search_validate.py).
`quant search SRC --dry-run`: what the streamed Fisher estimate would cost (memory, FLOPs, bytes read), from
config.json alone (quant.search.cost)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from quant.errors import QuantError
from quant.gptq.calibration import DEFAULT_DATA, CalibrationSettings


def command(
    src: Path = typer.Argument(..., metavar="SRC", help="A BF16 source: a checkpoint directory, or ORG/NAME[@REV] on "
                               "the Hub (downloaded into its cache first, every file checked, as --method gptq does)."),
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
    min_recovery: float = typer.Option(None, "--min-recovery", help="Validate: the smallest pick of the front whose "
                                       "quant eval against --baseline passes with each task's recovery at least "
                                       "this fraction (the budget flags then only cap the front)."),
    baseline: str = typer.Option(None, "--baseline", help="With --min-recovery: the eval's baseline (checkpoint or "
                                 "server URL)."),
    tasks: str = typer.Option(None, "--tasks", help="With --min-recovery: the eval tasks (as quant eval --tasks)."),
    work: Path = typer.Option(None, "--work", help="Where the search keeps its state (new, or made by quant search): "
                              "the estimate's progress, which a rerun resumes, and with --min-recovery the tried "
                              "exports and their evals (then default: beside --out)."),
    min_acceptance: float = typer.Option(None, "--min-acceptance", help="With --min-recovery: the MTP layer's "
                                         "smallest format whose measured draft acceptance rate is at least this."),
    limit: int = typer.Option(None, "--limit", help="With --min-recovery: questions per task (quant eval --limit, "
                              "default 200; 0 for all)."),
    margin: float = typer.Option(2.0, "--margin", help="With --min-recovery: quant eval's non-inferiority margin "
                                 "in points."),
    max_gen_toks: int = typer.Option(None, "--max-gen-toks", help="With --min-recovery: quant eval --max-gen-toks."),
    batch_size: int = typer.Option(16, "--batch-size", help="With --min-recovery: quant eval --batch-size."),
    max_disk: str = typer.Option(None, "--max-disk", help="A Hub source: refuse to download more than this (e.g. "
                                 "1.6TB) into the Hugging Face cache."),
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

    validating = min_recovery is not None
    _refuse_bad_arguments(out, plot, overwrite, max_size, bits, sensitivity, validating,
                          {"--baseline": baseline, "--tasks": tasks, "--min-acceptance": min_acceptance,
                           "--limit": limit})
    limit_bytes = parse_size(max_size, "--max-size") if max_size is not None else None
    disk = parse_size(max_disk, "--max-disk") if max_disk else None
    calib = CalibrationSettings(calib_data or DEFAULT_DATA, calib_samples, calib_seq_len)
    calib.require_local_file()
    if validating:
        from quant.commands.search_validate import Validation, check

        questions = Validation.limit if limit is None else limit or None  # quant eval's default; 0: all
        v = Validation(baseline, tasks, min_recovery, min_acceptance, questions, margin, max_gen_toks, batch_size)
        check(v)
        work = work if work is not None else out.with_name(out.name + ".work")
    if work is not None:  # every argument checked: the first thing written, before any download or measurement
        from quant.commands.search_validate import claim_work

        claim_work(work)
    src = _local_source(src, disk)
    log = (lambda _m: None) if as_json else typer.echo
    if validating:
        from quant.commands.search_validate import search_validated

        result = search_validated(src, engine or None, calib, v, work, max_size=limit_bytes, bits=bits,
                                  log=lambda m: typer.echo(m, err=as_json),  # with --json: on stderr
                                  sensitivity=sensitivity)
        out.write_text(result.pop("recipe_yaml"))
        if as_json:
            typer.echo(json.dumps(result, indent=1))
            return
        chosen = result["chosen"]
        typer.echo(f"wrote {out}: {chosen['size_bytes']} bytes, {chosen['effective_bits']} effective bits, "
                   f"{chosen['verdict']} against {baseline} ({len(result['evaluated'])} of {result['front_size']} "
                   f"picks evaluated; export {chosen['export']})")
        return
    result = search(src, engine or None, calib, max_size=limit_bytes, bits=bits, log=log, sensitivity=sensitivity,
                    state_dir=work / "estimate" if work is not None else None)
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


def _local_source(src: Path, max_disk: int | None) -> Path:
    """A directory as it is; ORG/NAME[@REV] downloaded into the Hugging Face cache first, every file checked against
    the Hub's sha256 (the search reads every layer twice: it does not stream)."""
    if src.is_dir():
        return src
    from quant.hub import hub_reference
    from quant.pipeline.snapshot import cached_source

    ref = hub_reference(str(src))
    if ref is None:
        raise QuantError(f"{src}: not a checkpoint directory, nor a Hub repository ORG/NAME[@REVISION]")
    return cached_source(ref, max_disk, lambda m: typer.echo(m, err=True))[0]


def _refuse_bad_arguments(out: Path | None, plot: Path | None, overwrite: bool, max_size: str | None,
                          bits: float | None, sensitivity: str, validating: bool, validation_flags: dict) -> None:
    """Every refusal that needs no source: one line, exit 2, before anything is downloaded, read or written."""
    from quant.search.run import SENSITIVITIES

    if out is None:
        raise QuantError("give --out RECIPE.yaml (the recipe to write), or --dry-run")
    if not validating and (max_size is None) == (bits is None):
        raise QuantError("give one budget: --max-size SIZE or --bits B (or --min-recovery R to validate)")
    if validating and max_size is not None and bits is not None:
        raise QuantError("give at most one budget with --min-recovery: --max-size SIZE or --bits B")
    given = [flag for flag, value in validation_flags.items() if value is not None]
    if not validating and given:
        raise QuantError(f"{given[0]} validates the pick: give --min-recovery R with it")
    if validating and (validation_flags["--baseline"] is None or validation_flags["--tasks"] is None):
        raise QuantError("--min-recovery needs --baseline BASE and --tasks T (what quant eval compares)")
    if bits is not None and not 1 <= bits <= 16:
        raise QuantError(f"--bits {bits}: must be between 1 and 16")
    if sensitivity not in SENSITIVITIES:
        raise QuantError(f"--sensitivity {sensitivity}: one of {', '.join(SENSITIVITIES)}")
    for path in (out, plot):
        if path is not None and path.exists() and not overwrite:
            raise QuantError(f"{path} exists; pass --overwrite to replace it")
        if path is not None and not path.parent.is_dir():
            raise QuantError(f"{path}: its directory {path.parent} does not exist")
