"""Evidence before a verdict: what must hold before `quant eval` may say pass or fail.

- Every arm got its answers: an arm whose failed requests exceed `FAILED_TOLERANCE` of its generations (server
  errors, timeouts, bodies that are not JSON, responses with the wrong number of choices) ends the run as an
  error (EvidenceMissing, exit 69), never as a pass or a fail: a broken baseline must not make a candidate look
  good, and a broken candidate server is not a quantization regression.
- Every arm is above its floor: a task's accuracy at or below its floor (its record's `floor`: chance level for
  multiple choice, a documented minimum for free-form answers) means the setup is broken (prompt format, chat
  template, tokenizer, server), not that two models are equally good; so is the baseline's depth-1 draft
  acceptance at or below `ACCEPTANCE_FLOOR` (a dead candidate draft beside a working baseline one is a fail: the
  damage the check exists for). Such a verdict is `invalid` (exit 4).
- Accuracy and acceptance are judged together: a candidate whose accuracy collapsed to the floor while its draft
  acceptance stays non-inferior (ROCm/ATOM#646: GSM8K 0 with 96.6% acceptance) is reported as inconsistent.
- An inconclusive verdict says what would decide it.
"""

from __future__ import annotations

import math
from dataclasses import replace

from evals.statistics.results import ComparisonRow
from evals.statistics.verdict import Verdict
from quant.errors import EvidenceMissing

FAILED_TOLERANCE = 0.01   # failed requests an arm may have, as a share of its generations (1 in 100)
ACCEPTANCE_FLOOR = 0.05   # depth-1 draft acceptance at or below this: the draft is not working in that arm
INVALID = Verdict.INVALID


def check_failures(label: str, arm: dict, generations: int) -> None:
    """Raise EvidenceMissing when `arm` failed more requests than the tolerance allows."""
    failed = int(arm.get("failed_requests") or 0)
    allowed = math.floor(FAILED_TOLERANCE * generations)
    if failed > allowed:
        why = f"; first error: {arm['first_error']}" if arm.get("first_error") else ""
        raise EvidenceMissing(f"{label} {arm.get('source')}: {failed} of {generations} requests failed (at most "
                              f"{allowed} tolerated, {FAILED_TOLERANCE:.0%}){why}; no verdict: fix the server and "
                              f"run again")


def floor_problems(rows: list[ComparisonRow], floors: dict[str, float]) -> list[str]:
    """One line per primary row (or its acceptance) where an arm is at or below its floor; marks those rows."""
    problems = []
    for row in rows:
        if not row.primary:
            continue
        c = row.comparison
        floor = floors.get(row.task, 0.0)
        low = [arm for arm in ("baseline", "candidate") if getattr(c, f"{arm}_accuracy") <= floor]
        if low:
            # One record for every surface (table, report.md, report.json, PNG, card): the row itself says invalid.
            row.validity = f"{' and '.join(low)} at or below the floor ({floor:.0%})"
            row.comparison = replace(c, verdict=INVALID)
            scores = " and ".join(f"{arm} {getattr(c, arm + '_accuracy'):.1%}" for arm in low)
            problems.append(f"{row.label}: {scores} is at "
                            f"or below the task's floor of {floor:.0%}: the setup is broken (prompt format, chat "
                            f"template, tokenizer or server), not evidence about the weights")
        a = row.acceptance
        if a and a.verdict_on.startswith("depth-1"):
            # A dead candidate draft beside a working baseline draft is the failure the check exists for (fail);
            # a dead baseline draft leaves nothing to compare with.
            dead = [arm for arm in ("baseline", "candidate") if getattr(a, f"{arm}_rate") <= ACCEPTANCE_FLOOR]
            if "baseline" in dead:
                a.validity = f"{' and '.join(dead)} at or below {ACCEPTANCE_FLOOR:.0%} depth-1 acceptance"
                a.verdict = INVALID
                problems.append(f"{row.label} MTP: depth-1 acceptance of {' and '.join(dead)} is at or below "
                                f"{ACCEPTANCE_FLOOR:.0%}: the draft does not work in that arm, so acceptance "
                                f"cannot be compared")
            elif "candidate" in low and "baseline" not in low and a.verdict == Verdict.PASS:
                problems.append(f"{row.label}: inconsistent: the candidate's accuracy collapsed while its draft "
                                f"acceptance ({a.candidate_rate:.1%}) stayed non-inferior; the draft agrees with "
                                f"a target that no longer answers (ROCm/ATOM#646), look at the candidate's answers")
    return problems


def next_steps(rows: list[ComparisonRow], limit: int | None, questions: dict[str, int],
               sampled: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """What would decide each inconclusive comparison. `questions`: {task: questions in its set}; `sampled`: the
    tasks generated with seeds, which more seeds can decide even when run with one."""
    steps = []
    for row in rows:
        if not row.primary:
            continue
        c = row.comparison
        if c.verdict == Verdict.INCONCLUSIVE:
            n, have = c.n_to_pass, c.n_questions
            available = questions.get(row.task)
            if n and (available is None or n <= available):
                steps.append(f"{row.label}: run at least {n} questions (--limit {n}; this run had {have}) to "
                             f"pass at this discordance, or it may fail with more evidence")
            elif row.seeds and len(row.seeds) > 1 or row.task in sampled:
                steps.append(f"{row.label}: the whole set ({have} questions) cannot decide at this margin; add "
                             f"generation seeds (--seeds) to average out sampling, or accept a wider --margin "
                             f"deliberately")
            else:
                steps.append(f"{row.label}: {have} questions cannot decide at this margin with the observed "
                             f"discordance; evaluate more questions (--limit 0 for all) or a larger task")
        a = row.acceptance
        if a and a.verdict == Verdict.INCONCLUSIVE:
            steps.append(f"{row.label} MTP: the acceptance interval contains -margin; more generations (a larger "
                         f"--limit) narrow it")
    return steps
