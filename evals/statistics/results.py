"""The eval's results as the program holds them: one `ComparisonRow` per task and lm-eval filter (its paired
accuracy comparison, the recovery, the MTP acceptance comparison and each arm's generation counts) and the
`EvalReport` over them (the verdict, each arm's record, the settings and the methods). `to_json` is report.json's
form, made where the report is written."""

from __future__ import annotations

from dataclasses import dataclass

from evals.statistics.acceptance import AcceptanceComparison
from evals.statistics.accuracy import Comparison
from evals.statistics.pairing import GenerationCounts
from evals.statistics.recovery import Recovery
from evals.statistics.verdict import Verdict


@dataclass
class ComparisonRow:
    task: str
    label: str
    filter: str
    primary: bool                       # the task's primary filter: the one the verdict is on
    seeds: list[int]
    comparison: Comparison
    recovery: Recovery
    acceptance: AcceptanceComparison | None
    baseline_generations: GenerationCounts
    candidate_generations: GenerationCounts
    validity: str | None = None         # why an arm's accuracy is no evidence (evidence.floor_problems), only then

    def to_json(self) -> dict:
        """The row as report.json holds it: these keys in this order, `validity` only where set."""
        row = {"task": self.task, "label": self.label, "filter": self.filter, "primary": self.primary,
               "seeds": self.seeds, "comparison": self.comparison.to_json(), "recovery": self.recovery.to_dict(),
               "acceptance": self.acceptance.to_json() if self.acceptance else None,
               "baseline_generations": self.baseline_generations.to_json(),
               "candidate_generations": self.candidate_generations.to_json()}
        if self.validity is not None:
            row["validity"] = self.validity
        return row


@dataclass
class EvalReport:
    verdict: Verdict
    exit_code: int
    margin_points: float
    mtp_margin_points: float
    problems: list[str]                 # why no verdict on accuracy can be given (evidence.floor_problems)
    next_steps: list[str]               # what would decide an inconclusive verdict
    baseline: dict                      # each arm: source, name, kind, description, notes, failures, mtp
    candidate: dict
    settings: dict
    rows: list[ComparisonRow]
    methods: dict[str, str]
    gate: dict | None = None            # the CI gate's checks (evals/gate.py), only with --gate

    def primary_row(self, task: str) -> ComparisonRow | None:
        """The row of `task`'s primary filter, if the run has it."""
        return next((r for r in self.rows if r.task == task and r.primary), None)

    def to_json(self) -> dict:
        """report.json: these keys in this order (`gate` last, only with a gate), the verdict as its value."""
        report = {"verdict": self.verdict.value, "exit_code": self.exit_code, "margin_points": self.margin_points,
                  "mtp_margin_points": self.mtp_margin_points, "problems": self.problems,
                  "next_steps": self.next_steps, "baseline": self.baseline, "candidate": self.candidate,
                  "settings": self.settings, "rows": [r.to_json() for r in self.rows], "methods": self.methods}
        if self.gate is not None:
            report["gate"] = self.gate
        return report
