"""Typed eval results for tests (evals/statistics/results.py): a row or a report with only the figures a test
sets, the rest taken from a real comparison of two small answer sets."""

from __future__ import annotations

from dataclasses import replace

from evals.statistics import accuracy
from evals.statistics.acceptance import AcceptanceComparison, compare_acceptance
from evals.statistics.pairing import GenerationCounts
from evals.statistics.recovery import Recovery
from evals.statistics.results import ComparisonRow, EvalReport
from evals.statistics.verdict import Verdict

_QUESTION = {"positions": 10, "accepted_depth1": 8, "rounds": 4, "tokens": 10, "depth": 3}


def acceptance(**figures) -> AcceptanceComparison:
    """An acceptance comparison on depth-1 acceptance with `figures` (baseline_rate=..., verdict="fail", ...)."""
    if "verdict" in figures:
        figures["verdict"] = Verdict(figures["verdict"])
    return replace(compare_acceptance([_QUESTION], [_QUESTION], margin=0.05, resamples=10), **figures)


def row(task: str = "gsm8k", *, primary: bool = True, seeds=(0,), acceptance: AcceptanceComparison | None = None,
        **figures) -> ComparisonRow:
    """A row of `task` whose comparison has `figures` (baseline_accuracy=..., verdict="inconclusive", ...)."""
    if "verdict" in figures:
        figures["verdict"] = Verdict(figures["verdict"])
    comparison = replace(accuracy.compare([1.0, 0.0], [1.0, 0.0], margin=0.02), **figures)
    counts = GenerationCounts(comparison.n_questions, 0, 0)
    return ComparisonRow(task=task, label=task, filter="flexible-extract", primary=primary, seeds=list(seeds),
                         comparison=comparison, recovery=Recovery(None, None, None, 0.95), acceptance=acceptance,
                         baseline_generations=counts, candidate_generations=counts)


def report(rows: list[ComparisonRow], candidate: dict | None = None) -> EvalReport:
    return EvalReport(verdict=Verdict.PASS, exit_code=0, margin_points=2.0, mtp_margin_points=5.0, problems=[],
                      next_steps=[], baseline={"name": "base"}, candidate=candidate or {"name": "cand"},
                      settings={}, rows=rows, methods={})
