"""`quant search --min-recovery R --baseline BASE --tasks T`: the smallest pick of the search's Pareto front whose
`quant eval` against BASE passes, found by bisection over the front by size (a bigger pick is assumed never to
evaluate worse; the front's picks the preflight refuses are left out first, as `quant search` previews its pick),
each tried pick exported into --work and judged by the eval stage's own `evaluate` (its verdict: the accuracy
margin, the floors, the MTP acceptance margin) and its recovery. With --min-acceptance A the MTP
layer's format, which the search pins to its smallest loadable one, is then decided by the draft acceptance the eval
measures: smallest first, the first at or above A."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from evals.compare import EvalRequest, evaluate
from evals.statistics.paired_interval import first_passing as least_passing
from evals.statistics.verdict import Verdict
from quant.checkpoint import open_checkpoint
from quant.errors import QuantError
from quant.gptq.calibration import CalibrationSettings
from quant.pipeline.run import quantize_checkpoint
from quant.search.loadable import preview_errors
from quant.search.recipe_file import recipe_yaml
from quant.search.run import measure
from quant.search.searched import Searched
from quant.search.solver import pareto_front

WORK_MARK = ".quant-search-work.json"  # what makes --work ours: written when this command creates it


class NothingPasses(QuantError):
    """No pick of the front passes (or no MTP format reaches --min-acceptance): `quant eval`'s fail, exit 1."""

    exit_code = 1


@dataclass(frozen=True)
class Validation:
    """How each pick is judged: `quant eval --baseline BASE --tasks T` with these settings, then its recovery."""

    baseline: str
    tasks: str
    min_recovery: float  # each task's recovery (candidate accuracy / baseline's) at least this
    min_acceptance: float | None = None  # the MTP draft's depth-1 acceptance rate at least this
    limit: int | None = EvalRequest.limit  # questions per task; None: all
    margin: float = EvalRequest.margin
    max_gen_toks: int | None = None
    batch_size: int = EvalRequest.batch_size


def check(v: Validation) -> None:
    if not 0 < v.min_recovery <= 1:
        raise QuantError(f"--min-recovery {v.min_recovery:g}: a fraction of the baseline's accuracy in (0, 1]")
    if v.min_acceptance is not None and not 0 < v.min_acceptance <= 1:
        raise QuantError(f"--min-acceptance {v.min_acceptance:g}: a draft acceptance rate in (0, 1]")


def claim_work(work: Path) -> None:
    """--work: new or empty (then marked ours), or one this command made; anything else is refused, never emptied."""
    if work.exists() or work.is_symlink():
        if not work.is_dir() or work.is_symlink() or (any(work.iterdir()) and not (work / WORK_MARK).is_file()):
            raise QuantError(f"--work {work}: exists and was not made by quant search; give a new directory")
    work.mkdir(parents=True, exist_ok=True)
    if not (work / WORK_MARK).exists():
        (work / WORK_MARK).write_text(json.dumps({"tool": "quant search", "holds": "exports and evals"}) + "\n")


def search_validated(src: Path, engines: list[str] | None, calib: CalibrationSettings, v: Validation, work: Path,
                     max_size: int | None = None, bits: float | None = None,
                     log: Callable[[str], None] = print, sensitivity: str = "fisher") -> dict:
    check(v)
    claim_work(work)
    searched = measure(src, engines, calib, log=log, sensitivity=sensitivity, state_dir=work / "estimate")
    if v.min_acceptance is not None and not searched.mtp_menus:
        raise QuantError(f"--min-acceptance: {src} has no MTP layer")
    front = [p.choices for p in pareto_front([c.options for c in searched.choices])]
    front = [p for p in front if (max_size is None or searched.size(p) <= max_size)
             and (bits is None or searched.effective_bits(p) <= bits)]
    ckpt = open_checkpoint(src)  # read once for every pick's preview
    front = [p for p in front if not preview_errors(ckpt, searched, p, engines, "even")]  # as loadable_pick keeps
    if not front:
        raise QuantError(f"no mix of the engines' formats fits {'--bits' if bits else '--max-size'}")
    log(f"validate: bisecting {len(front)} picks of the front by size against {v.baseline} on {v.tasks}")
    judge = _Judge(src, v, work, log)
    first = first_passing(len(front), lambda i: judge(searched, front[i], f"front {i + 1}/{len(front)}", i)["passed"])
    if first is None:
        raise NothingPasses(f"no pick of the front passes quant eval against {v.baseline} with recovery >= "
                            f"{v.min_recovery:g}, the largest ({searched.size(front[-1])} bytes) included; see {work}")
    chosen, row = searched, judge.by_key[judge.key(searched, front[first])]
    if v.min_acceptance is not None:
        chosen, row = decide_mtp(searched, front[first], judge, v.min_acceptance)
    return {"recipe": {c.unit.name: c.options[i].label for c, i in zip(chosen.choices, front[first])},
            "recipe_yaml": row["_yaml"], "size_bytes": row["size_bytes"],
            "effective_bits": row["effective_bits"], "predicted_loss": row["predicted_loss"],
            "front_size": len(front),
            "validation": asdict(v), "evaluated": [_public(r) for r in judge.rows],
            "chosen": _public(row)}


def first_passing(n: int, passes: Callable[[int], bool]) -> int | None:
    """The least i in [0, n) with passes(i), for a `passes` monotone in i (False then True), or None: a bisection
    asking at most ceil(log2(n + 1)) times (index n stands for "none passes" and is never asked)."""
    first = least_passing(0, n, lambda i: i == n or passes(i))
    return first if first < n else None


def decide_mtp(searched: Searched, picks: tuple[int, ...], judge: Callable[[Searched, tuple[int, ...], str], dict],
               least: float) -> tuple[Searched, dict]:
    """The formats every MTP unit loads, smallest first: the first whose measured draft acceptance is at least
    `least` (the smallest, pinned by the search, was judged with the pick itself; the draft never changes the
    answers, so only its acceptance decides)."""
    menus = list(searched.mtp_menus.values())
    common = [o.label for o in menus[0].options if all(o.label in {x.label for x in m.options} for m in menus)]
    size = {t: sum(next(o.size_bytes for o in m.options if o.label == t) for m in menus) for t in common}
    for treatment in sorted(common, key=lambda t: size[t]):
        variant = searched.with_mtp(treatment)
        row = judge(variant, picks, f"mtp {treatment}")
        if row["acceptance"] is not None and row["acceptance"] >= least:
            return variant, row
    raise NothingPasses(f"no MTP format reaches --min-acceptance {least:g} on the chosen pick "
                        f"({', '.join(sorted(common, key=lambda t: size[t]))} tried)")


def _public(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("_")}


class _Judge:
    """Exports a pick into --work and runs `quant eval` on it (the baseline's answers of the first run reused by
    the rest); each pick is judged once."""

    def __init__(self, src: Path, v: Validation, work: Path, log: Callable[[str], None]):
        self.src, self.v, self.work, self.log = src, v, work, log
        self.rows: list[dict] = []
        self.by_key: dict[str, dict] = {}
        self.baseline_run: Path | None = None

    def key(self, searched: Searched, picks: tuple[int, ...]) -> str:
        labels = [(c.unit.name, c.options[i].label) for c, i in zip(searched.choices, picks)]
        settings = {k: val for k, val in asdict(self.v).items() if k not in ("min_recovery", "min_acceptance")}
        return hashlib.sha256(json.dumps([labels, settings], sort_keys=True).encode()).hexdigest()[:10]

    def __call__(self, searched: Searched, picks: tuple[int, ...], what: str, index: int | None = None) -> dict:
        key = self.key(searched, picks)
        if key in self.by_key:
            return self.by_key[key]
        size, bits = searched.size(picks), searched.effective_bits(picks)
        loss = round(sum(c.options[i].loss for c, i in zip(searched.choices, picks)), 6)
        text = recipe_yaml(searched, picks, f"quant search: {size} bytes, {bits} effective bits, predicted KL "
                           f"{loss:.5f} nats")
        stem = self.work / f"{size}-{key}"
        recipe = self.work / f"{stem.name}.yaml"
        recipe.write_text(text)
        quantize_checkpoint(self.src, stem, recipe=str(recipe), check_engines=None, log=lambda m: None)
        out = self.work / f"{stem.name}.eval"
        report = evaluate(EvalRequest(
            candidate=str(stem), baseline=None if self.baseline_run else self.v.baseline,
            baseline_run=self.baseline_run, tasks=self.v.tasks, out=out, limit=self.v.limit, margin=self.v.margin,
            max_gen_toks=self.v.max_gen_toks, batch_size=self.v.batch_size), log=lambda m: None)
        self.baseline_run = self.baseline_run or out
        primary = [r for r in report.rows if r.primary]
        recovery = {r.task: {"ratio": r.recovery.ratio, "ci_low": r.recovery.ci_low, "ci_high": r.recovery.ci_high}
                    for r in primary}
        rates = [r.acceptance.candidate_rate for r in primary if r.acceptance is not None]
        passed = report.verdict == Verdict.PASS and all(
            x["ratio"] is not None and x["ratio"] >= self.v.min_recovery for x in recovery.values())
        row = {"what": what, "front_index": index, "size_bytes": size, "effective_bits": bits, "predicted_loss": loss,
               "mtp": next(iter(searched.pinned.values()), None), "verdict": report.verdict.value,
               "recovery": recovery, "acceptance": min(rates) if rates else None, "passed": passed,
               "export": str(stem), "report": str(out / "report.json"), "_yaml": text}
        self.rows.append(row)
        self.by_key[key] = row
        self.log(_line(row))
        return row


def _line(row: dict) -> str:
    rec = ", ".join(f"{t} {x['ratio']:.3f} [{x['ci_low']:.3f}, {x['ci_high']:.3f}]" if x["ratio"] is not None
                    else f"{t} n/a" for t, x in row["recovery"].items())
    acc = f"  acceptance {row['acceptance']:.3f}" if row["acceptance"] is not None else ""
    return (f"  {row['what']:>12}  {row['size_bytes']:>12} bytes  {row['effective_bits']:7.4f} bits  "
            f"KL {row['predicted_loss']:.5f}  {row['verdict']:<12} recovery {rec}{acc}"
            f"  -> {'pass' if row['passed'] else 'no'}")
