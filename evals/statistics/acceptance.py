"""Speculative-decoding acceptance of an MTP draft, from per-position tokens (pure functions, numpy in, numbers out).

Positions: x[0..L-1] is prompt + generation, the generation starting at P. target_next[t] is the target's greedy
token after x[0..t] (its prediction for x[t+1]). A decode round starts from an anchor c, the last verified token:
the draft proposes d1..dk for x[c+1..c+k] (drafts[j-1][c]), the target accepts the longest prefix with
d_j == target_next[c+j-1] and adds one token of its own, so the round yields n + 1 tokens and the next anchor is
c + n + 1. The first anchor is P (the prefill produced x[P]). This is greedy verification as in SGLang's and vLLM's
MTP/EAGLE paths with one draft chain (topk 1).

Per question: `positions` anchors in P..L-2 and `accepted_depth1` of them whose first draft matches (depth-1
acceptance); `rounds` and `tokens` of the simulated decode with `depth` drafts per round (mean accepted length =
tokens / rounds, the "accept length" SGLang reports and vLLM's "mean acceptance length").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from evals.statistics.verdict import Verdict

PASS, FAIL, INCONCLUSIVE = Verdict.PASS, Verdict.FAIL, Verdict.INCONCLUSIVE


@dataclass(frozen=True)
class QuestionAcceptance:
    positions: int       # anchors measured for depth-1 acceptance
    accepted_depth1: int
    rounds: int          # verification rounds of the simulated decode
    tokens: int          # tokens those rounds produced
    depth: int

    def to_json(self) -> dict:
        return asdict(self)


def simulate(target_next, drafts, start: int, depth: int) -> QuestionAcceptance:
    """Acceptance along one sequence: `target_next` [L], `drafts` [depth, L] (drafts[j][c]: the (j+1)-th draft
    token proposed at anchor c), the generation starting at `start`."""
    target_next = np.asarray(target_next)
    drafts = np.asarray(drafts).reshape(depth, -1)
    last = len(target_next) - 2  # the last anchor whose next token is part of the sequence
    anchors = range(start, last + 1)
    positions = len(anchors)
    accepted = int(sum(drafts[0][c] == target_next[c] for c in anchors))
    rounds = tokens = 0
    c = start
    while c <= last:
        n = 0
        while n < depth and c + n <= last and drafts[n][c] == target_next[c + n]:
            n += 1
        step = min(n + 1, last + 1 - c)
        rounds += 1
        tokens += step
        c += step
    return QuestionAcceptance(positions, accepted, rounds, tokens, depth)


def rates(questions) -> tuple[float, float]:
    """(depth-1 acceptance rate, mean accepted length) pooled over questions (ratios of sums)."""
    pos = sum(q["positions"] for q in questions)
    acc = sum(q["accepted_depth1"] for q in questions)
    rounds = sum(q["rounds"] for q in questions)
    tokens = sum(q["tokens"] for q in questions)
    return (acc / pos if pos else float("nan")), (tokens / rounds if rounds else float("nan"))


def _arrays(questions) -> np.ndarray:
    return np.array([[q["positions"], q["accepted_depth1"], q["rounds"], q["tokens"]] for q in questions],
                    dtype=float).reshape(-1, 4)


def _pooled(a: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pooled (rate, length) of each bootstrap resample (rows of question indices)."""
    sums = a[idx].sum(axis=1)  # [B, 4]
    with np.errstate(invalid="ignore", divide="ignore"):
        return sums[:, 1] / sums[:, 0], sums[:, 3] / sums[:, 2]


@dataclass
class AcceptanceComparison:
    """The paired comparison of two arms' MTP draft acceptance (`compare_acceptance`): each arm's depth-1 rate and
    mean accepted length with their intervals, the paired differences and the non-inferiority verdict. `validity`:
    why the comparison is no evidence (evals/statistics/evidence.py), set only then."""

    n_questions: int
    depth: int | None
    baseline_rate: float
    baseline_rate_ci: tuple[float, float]
    candidate_rate: float
    candidate_rate_ci: tuple[float, float]
    baseline_length: float
    baseline_length_ci: tuple[float, float]
    candidate_length: float
    candidate_length_ci: tuple[float, float]
    rate_difference: float
    rate_ci_low: float      # of the verdict's measure
    rate_ci_high: float
    length_difference: float
    length_ci: tuple[float, float]
    questions_worse: int
    questions_better: int
    ci_level: float
    resamples: int
    margin: float
    verdict_on: str
    verdict: Verdict
    validity: str | None = None

    def to_json(self) -> dict:
        """The report's form: the fields in order, the verdict as its value, `validity` only where set."""
        data = {**asdict(self), "verdict": self.verdict.value}
        if data["validity"] is None:
            del data["validity"]
        return data


def compare_acceptance(baseline, candidate, *, margin: float, resamples: int = 10_000, level: float = 0.95,
                       seed: int = 0) -> AcceptanceComparison:
    """Paired comparison of two arms' per-question acceptance (aligned lists of QuestionAcceptance dicts).

    The interval of candidate - baseline depth-1 acceptance (and of the mean accepted length) is a paired
    percentile bootstrap: questions are resampled, the same indices in both arms, and the pooled ratios recomputed.
    Verdict (non-inferiority on depth-1 acceptance): pass when the interval lies above -margin, fail when it lies
    below, inconclusive otherwise."""
    b, c = _arrays(baseline), _arrays(candidate)
    if b.shape != c.shape:
        raise ValueError(f"acceptance arrays must be aligned, got {b.shape} and {c.shape}")
    n = len(b)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(resamples, n)) if n else np.zeros((resamples, 0), dtype=int)
    b_rate, b_len = _pooled(b, idx)
    c_rate, c_len = _pooled(c, idx)
    tail = (1 - level) / 2
    d_rate, d_len = c_rate - b_rate, c_len - b_len

    def interval(x):
        x = x[np.isfinite(x)]
        return (float(np.quantile(x, tail)), float(np.quantile(x, 1 - tail))) if x.size else (float("nan"),) * 2

    br, bl = rates(baseline)
    cr, cl = rates(candidate)
    if b[:, 0].sum() and c[:, 0].sum():
        measure = "depth-1 acceptance (points)"
        low, high = interval(d_rate)
    else:
        # A server arm that only reports rounds and tokens (SGLang): the relative change of the mean accepted
        # length decides, against the same margin as a fraction.
        measure = "mean accepted length (relative)"
        with np.errstate(invalid="ignore", divide="ignore"):
            low, high = interval(c_len / b_len - 1)
    verdict = PASS if low > -margin else FAIL if high < -margin else INCONCLUSIVE
    per_question = (c[:, 1] / np.maximum(c[:, 0], 1)) - (b[:, 1] / np.maximum(b[:, 0], 1))
    return AcceptanceComparison(
        n_questions=n, depth=int(baseline[0]["depth"]) if n else None,
        baseline_rate=br, baseline_rate_ci=interval(b_rate),
        candidate_rate=cr, candidate_rate_ci=interval(c_rate),
        baseline_length=bl, baseline_length_ci=interval(b_len),
        candidate_length=cl, candidate_length_ci=interval(c_len),
        rate_difference=cr - br, rate_ci_low=low, rate_ci_high=high,
        length_difference=cl - bl, length_ci=interval(d_len),
        questions_worse=int((per_question < 0).sum()), questions_better=int((per_question > 0).sum()),
        ci_level=level, resamples=resamples, margin=margin, verdict_on=measure, verdict=verdict,
    )
