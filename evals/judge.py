"""The comparison judged: the arms' answers paired into one report row per task and lm-eval filter, the verdict
over them (evals.statistics), and a CI gate (evals/gate.py) read, checked against the run, applied to the report
and written from its baseline arm."""

from __future__ import annotations

from evals.gate import DEFAULT_GATE_TASK, apply_gate, check_run, gate_from_baseline, read_gate, write_gate
from evals.report.render import METHODS
from evals.request import EvalRequest
from evals.statistics import accuracy, evidence
from evals.statistics.acceptance import compare_acceptance
from evals.statistics.pairing import generation_counts, pair_acceptance, pair_scores
from evals.statistics.recovery import recovery
from evals.statistics.results import ComparisonRow, EvalReport
from evals.statistics.verdict import Verdict

EXIT_CODES = {Verdict.PASS: 0, Verdict.FAIL: 1, Verdict.INCONCLUSIVE: 3, Verdict.INVALID: 4}


def compare_records(baseline: list[dict], candidate: list[dict], specs, request: EvalRequest
                    ) -> list[ComparisonRow]:
    """One report row per task and lm-eval filter."""
    rows = []
    for spec in specs:
        for filter_name in spec.filters:
            paired = pair_scores(baseline, candidate, spec.name, filter_name)
            comparison = accuracy.compare(paired.baseline, paired.candidate, margin=request.margin / 100.0,
                                       samples_per_question=len(paired.seeds))
            primary = filter_name == spec.primary_filter
            acceptance = pair_acceptance(baseline, candidate, spec.name, filter_name) if primary else None
            rows.append(ComparisonRow(
                task=spec.name, label=spec.label, filter=filter_name, primary=primary, seeds=paired.seeds,
                comparison=comparison, recovery=recovery(paired.baseline, paired.candidate),
                acceptance=compare_acceptance(*acceptance, margin=request.mtp_margin / 100.0) if acceptance else None,
                baseline_generations=generation_counts(baseline, spec.name, filter_name),
                candidate_generations=generation_counts(candidate, spec.name, filter_name),
            ))
    return rows


def build_report(request: EvalRequest, specs, settings: dict, baseline_arm: dict, candidate_arm: dict,
                 rows: list[ComparisonRow]) -> EvalReport:
    """The verdict over the rows (invalid when an arm is at its floor; else every primary comparison's and every
    acceptance comparison's, combined), and what would decide it when inconclusive."""
    problems = evidence.floor_problems(rows, {s.name: s.floor for s in specs})
    verdict = Verdict.INVALID if problems else \
        accuracy.combine_verdicts([r.comparison.verdict for r in rows if r.primary]
                                  + [r.acceptance.verdict for r in rows if r.acceptance])
    return EvalReport(verdict=verdict, exit_code=EXIT_CODES[verdict], margin_points=request.margin,
                      mtp_margin_points=request.mtp_margin, problems=problems,
                      next_steps=evidence.next_steps(rows, request.limit, {s.name: s.size for s in specs},
                                                     {s.name for s in specs if s.sampled})
                      if verdict == Verdict.INCONCLUSIVE else [],
                      baseline=baseline_arm, candidate=candidate_arm, settings=settings, rows=rows, methods=METHODS)


def read_request_gate(request: EvalRequest, specs):
    """The --gate file, checked against this run before any work (None without one)."""
    if request.gate is None:
        return None
    gate = read_gate(request.gate)
    check_run(gate, request.gate, specs, request.limit, request.mtp)
    return gate


def apply_request_gate(report: EvalReport, gate) -> None:
    """The gate's checks go into the report; a miss makes the verdict a fail (an invalid run stays invalid: it is
    no evidence either way)."""
    report.gate = apply_gate(gate, report)
    if not report.gate["passed"] and report.verdict != Verdict.INVALID:
        report.verdict, report.exit_code = Verdict.FAIL, EXIT_CODES[Verdict.FAIL]


def write_baseline_gate(request: EvalRequest, specs, report: EvalReport) -> None:
    """--write-gate: a gate from this run's baseline arm (on the gate format's own task where it ran, else the first
    task)."""
    spec = next((s for s in specs if s.name == DEFAULT_GATE_TASK), specs[0])
    write_gate(request.write_gate, gate_from_baseline(report, spec, request.margin, request.mtp_margin,
                                                      request.candidate_name))
