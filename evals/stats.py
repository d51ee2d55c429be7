"""Paired statistics for "is the candidate as accurate as the baseline?" (pure functions, numpy in, numbers out).

Inputs are per-question scores in [0, 1], aligned so that index i is the same question in both arms. With one
sample per question a score is 0 or 1; with several seeds (GPQA) it is the mean over the seeds, so the question
stays the unit of resampling and the seeds are never treated as independent questions (lm-eval.md section 8.3).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"


def accuracy_stderr(scores) -> float:
    """lm-eval's standard error of a mean (sample stddev with n-1, over sqrt(n)), as printed in its tables.

    For seed-averaged scores this is the question-clustered standard error."""
    from lm_eval.api.metrics import mean_stderr

    scores = np.asarray(scores, dtype=float)
    if scores.size < 2:
        return float("nan")
    return float(mean_stderr(scores.tolist()))


def paired_stderr(baseline, candidate) -> float:
    """Standard error of mean(candidate - baseline) over questions: sd(d_i) / sqrt(n).

    For 0/1 scores this equals sqrt((b+c) - (b-c)^2/n) / sqrt(n(n-1)) with b, c the discordant counts."""
    d = np.asarray(candidate, dtype=float) - np.asarray(baseline, dtype=float)
    if d.size < 2:
        return float("nan")
    return float(d.std(ddof=1) / np.sqrt(d.size))


def paired_bootstrap_ci(baseline, candidate, *, iterations: int = 10_000, seed: int = 0,
                        level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of mean(candidate - baseline), resampling questions with replacement (seeded)."""
    d = np.asarray(candidate, dtype=float) - np.asarray(baseline, dtype=float)
    if d.size == 0:
        raise ValueError("paired_bootstrap_ci needs at least one question")
    rng = np.random.default_rng(seed)
    means = np.empty(iterations)
    # Chunks keep the index matrix small for large n.
    chunk = max(1, 2_000_000 // d.size)
    for start in range(0, iterations, chunk):
        stop = min(iterations, start + chunk)
        means[start:stop] = d[rng.integers(0, d.size, size=(stop - start, d.size))].mean(axis=1)
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return float(low), float(high)


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


def verdict(ci: tuple[float, float], margin: float) -> str:
    """Non-inferiority against `margin` (a fraction, 0.02 = 2 points) on the interval of candidate - baseline.

    pass: the whole interval lies above -margin; fail: the whole interval lies below -margin;
    inconclusive: the interval contains -margin (more questions or seeds are needed to decide)."""
    low, high = ci
    if low > -margin:
        return PASS
    if high < -margin:
        return FAIL
    return INCONCLUSIVE


def combine_verdicts(verdicts) -> str:
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
    verdict: str

    def to_json(self) -> dict:
        return asdict(self)


def compare(baseline, candidate, *, margin: float, samples_per_question: int = 1, iterations: int = 10_000,
            seed: int = 0, level: float = 0.95) -> Comparison:
    """Compare aligned per-question scores (seed-averaged when `samples_per_question` > 1)."""
    baseline = np.asarray(baseline, dtype=float)
    candidate = np.asarray(candidate, dtype=float)
    if baseline.shape != candidate.shape or baseline.ndim != 1:
        raise ValueError(f"score arrays must be 1-D and aligned, got {baseline.shape} and {candidate.shape}")
    ci = paired_bootstrap_ci(baseline, candidate, iterations=iterations, seed=seed, level=level)
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
    )
