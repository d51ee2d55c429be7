"""Paired statistics for "is the candidate as accurate as the baseline?" (pure functions, numpy in, numbers out).

Inputs are per-question scores in [0, 1], aligned so that index i is the same question in both arms. With one
sample per question a score is 0 or 1; with several seeds (GPQA) it is the mean over the seeds, so the question
stays the unit of resampling and the seeds are never treated as independent questions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from evals.statistics.paired_interval import noninferiority_p, smallest_passing_n, tango_interval
from evals.statistics.verdict import Verdict

PASS, FAIL, INCONCLUSIVE = Verdict.PASS, Verdict.FAIL, Verdict.INCONCLUSIVE


def accuracy_stderr(scores) -> float:
    """lm-eval's standard error of a mean (sample stddev with n-1, over sqrt(n)), as printed in its tables:
    `lm_eval.api.metrics.mean_stderr`'s arithmetic in the same order (lm-eval 0.4.x), so the figures agree to the
    last bit without importing lm-eval here (tests/test_eval_stats.py checks it against lm-eval's own function).

    For seed-averaged scores this is the question-clustered standard error."""
    values = [float(x) for x in np.asarray(scores, dtype=float).tolist()]
    if len(values) < 2:
        return float("nan")
    mu = sum(values) / len(values)
    return math.sqrt(sum([(x - mu) ** 2 for x in values]) / (len(values) - 1)) / math.sqrt(len(values))


def paired_stderr(baseline, candidate) -> float:
    """Standard error of mean(candidate - baseline) over questions: sd(d_i) / sqrt(n).

    For 0/1 scores this equals sqrt((b+c) - (b-c)^2/n) / sqrt(n(n-1)) with b, c the discordant counts."""
    d = np.asarray(candidate, dtype=float) - np.asarray(baseline, dtype=float)
    if d.size < 2:
        return float("nan")
    return float(d.std(ddof=1) / np.sqrt(d.size))


def discordant_counts(baseline, candidate) -> tuple[int, int]:
    """(b, c): questions where the baseline scored higher, and where the candidate scored higher.

    For 0/1 scores these are McNemar's discordant pairs; for seed-averaged scores they are the signs of the
    per-question differences (ties dropped), i.e. the sign test that reduces to McNemar with one seed."""
    d = np.asarray(candidate, dtype=float) - np.asarray(baseline, dtype=float)
    return int((d < 0).sum()), int((d > 0).sum())


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: binomial test of min(b, c) out of b + c discordant pairs at p = 1/2."""
    from scipy.stats import binomtest

    if b + c == 0:
        return 1.0
    return float(binomtest(min(b, c), b + c, 0.5).pvalue)


def verdict(ci: tuple[float, float], margin: float) -> Verdict:
    """Non-inferiority against `margin` (a fraction, 0.02 = 2 points) on the interval of candidate - baseline.

    pass: the whole interval lies above -margin; fail: the whole interval lies below -margin;
    inconclusive: the interval contains -margin (more questions or seeds are needed to decide). With Tango's
    score interval a pass is the score test rejecting delta <= -margin at level (1 - ci level) / 2."""
    low, high = ci
    if low > -margin:
        return PASS
    if high < -margin:
        return FAIL
    return INCONCLUSIVE


def combine_verdicts(verdicts) -> Verdict:
    """The verdict of several comparisons: fail if any fails, else inconclusive if any is, else pass."""
    verdicts = list(verdicts)
    if FAIL in verdicts:
        return FAIL
    if INCONCLUSIVE in verdicts or not verdicts:
        return INCONCLUSIVE
    return PASS


@dataclass(frozen=True)
class Comparison:
    """Everything the report shows for one (task, filter): accuracies, paired difference, test and verdict."""

    n_questions: int
    samples_per_question: int
    baseline_accuracy: float
    baseline_stderr: float
    candidate_accuracy: float
    candidate_stderr: float
    difference: float
    difference_stderr: float
    ci_low: float
    ci_high: float
    ci_level: float
    baseline_only_correct: int
    candidate_only_correct: int
    mcnemar_p: float
    margin: float
    verdict: Verdict
    noninferiority_p: float  # one-sided score test of delta <= -margin
    n_to_pass: int | None  # fewest questions that could pass at this margin with the observed discordance

    def to_json(self) -> dict:
        return {**asdict(self), "verdict": self.verdict.value}


def discordance(baseline, candidate) -> tuple[float, float]:
    """(x, y): the discordance mass for the candidate and for the baseline. 0/1 scores: the discordant pair counts
    (c, b). Seed-averaged scores: sums of the positive and negative parts of the per-question differences, so a
    question contributes at most one unit (evals.statistics.paired_interval)."""
    d = np.asarray(candidate, dtype=float) - np.asarray(baseline, dtype=float)
    return float(np.clip(d, 0, None).sum()), float(np.clip(-d, 0, None).sum())


def compare(baseline, candidate, *, margin: float, samples_per_question: int = 1, level: float = 0.95
            ) -> Comparison:
    """Compare aligned per-question scores (seed-averaged when `samples_per_question` > 1)."""
    baseline = np.asarray(baseline, dtype=float)
    candidate = np.asarray(candidate, dtype=float)
    if baseline.shape != candidate.shape or baseline.ndim != 1:
        raise ValueError(f"score arrays must be 1-D and aligned, got {baseline.shape} and {candidate.shape}")
    if baseline.size == 0:
        raise ValueError("compare needs at least one question")
    x, y = discordance(baseline, candidate)
    n = float(baseline.size)
    ci = tango_interval(round(x, 9), round(y, 9), n, level)
    b, c = discordant_counts(baseline, candidate)
    return Comparison(
        n_questions=int(baseline.size),
        samples_per_question=samples_per_question,
        baseline_accuracy=float(baseline.mean()),
        baseline_stderr=accuracy_stderr(baseline),
        candidate_accuracy=float(candidate.mean()),
        candidate_stderr=accuracy_stderr(candidate),
        difference=float((candidate - baseline).mean()),
        difference_stderr=paired_stderr(baseline, candidate),
        ci_low=ci[0],
        ci_high=ci[1],
        ci_level=level,
        baseline_only_correct=b,
        candidate_only_correct=c,
        mcnemar_p=mcnemar_exact(b, c),
        margin=margin,
        verdict=verdict(ci, margin),
        noninferiority_p=noninferiority_p(x, y, n, margin),
        n_to_pass=smallest_passing_n(x, y, n, margin, level),
    )
