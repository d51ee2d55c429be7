"""Tango's score interval for the difference of two paired proportions, and the non-inferiority score test.

Why this interval: the percentile bootstrap of per-question differences collapses to [0, 0] when no question is
discordant, whatever n, and so "passes" on no evidence. Tango's asymptotic score interval (Tango 1998,
"Equivalence test and confidence interval for the difference in proportions for the paired-sample design",
Statistics in Medicine 17:891-908) inverts the score test of H0: delta = delta0 with the nuisance cell probability
at its constrained maximum-likelihood estimate; it stays informative at zero discordant pairs (the bound then
is the score-test analogue of the rule of three, 3.84 / (n + 3.84) for 95%) and keeps coverage near nominal for
small n and small discordance (Tango 1998 tables; Newcombe 1998, Stat Med 17:2635-2650, recommends it with his
method 10). The non-inferiority decision uses the same score statistic at delta0 = -margin (the test Tango and
Nam give for paired non-inferiority), so verdict and interval always agree.

Counts: x = questions only the candidate gets right, y = only the baseline, n = questions; delta = (x - y) / n.
They may be fractional: with several seeds per question, x = sum of positive parts of the seed-averaged
per-question differences and y of the negative parts, so each question counts at most once (the question, not
the seed, is the unit) and the interval does not collapse when every per-question difference is zero.
"""

from __future__ import annotations

from typing import Callable

import math
from functools import lru_cache

from scipy.optimize import brentq
from scipy.stats import norm


def _nuisance(x: float, y: float, n: float, delta0: float) -> float:
    """Constrained MLE of P(only the baseline right) under delta = delta0 (root of 2n t^2 - B t - y d (1-d))."""
    m = n - x - y
    b = x * (1 - delta0) + y * (1 - 3 * delta0) - 2 * m * delta0
    return (b + math.sqrt(max(b * b + 8 * n * y * delta0 * (1 - delta0), 0.0))) / (4 * n)


def score_statistic(x: float, y: float, n: float, delta0: float) -> float:
    """Tango's Z for H0: delta = delta0 (decreasing in delta0)."""
    t = _nuisance(x, y, n, delta0)
    variance = (2 * t + delta0 - delta0 * delta0) / n
    diff = (x - y) / n - delta0
    if variance <= 0:
        return math.copysign(math.inf, diff) if diff else 0.0
    return diff / math.sqrt(variance)


@lru_cache(maxsize=65536)
def tango_interval(x: float, y: float, n: float, level: float = 0.95) -> tuple[float, float]:
    """Two-sided `level` score interval for delta = (x - y) / n."""
    if n <= 0:
        raise ValueError("tango_interval needs at least one question")
    z = norm.ppf(0.5 + level / 2)
    estimate = (x - y) / n
    eps = 1e-12

    def bound(target: float, lo: float, hi: float) -> float:
        f = lambda d: score_statistic(x, y, n, d) - target  # noqa: E731
        if f(lo) * f(hi) > 0:
            return lo if abs(f(lo)) < abs(f(hi)) else hi
        return brentq(f, lo, hi, xtol=1e-10)

    low = -1.0 if estimate <= -1 + eps else bound(z, -1 + eps, min(estimate, 1 - eps))
    high = 1.0 if estimate >= 1 - eps else bound(-z, max(estimate, -1 + eps), 1 - eps)
    return float(low), float(high)


def noninferiority_p(x: float, y: float, n: float, margin: float) -> float:
    """One-sided p-value of the score test of H0: delta <= -margin against delta > -margin."""
    return float(norm.sf(score_statistic(x, y, n, -margin)))


def smallest_passing_n(x: float, y: float, n: float, margin: float, level: float = 0.95,
                       limit: int = 10_000_000) -> int | None:
    """The fewest questions at which the observed discordance rates (x/n, y/n) would give a lower bound above
    -margin; None when the observed difference itself is at or below -margin (no n would pass)."""
    if n <= 0 or (x - y) / n <= -margin:
        return None

    def passes(k: int) -> bool:
        return tango_interval(x * k / n, y * k / n, float(k), level)[0] > -margin

    hi = max(1, int(n))
    while not passes(hi):
        hi *= 2
        if hi > limit:
            return None
    return first_passing(1, hi, passes)


def first_passing(lo: int, hi: int, passes: Callable[[int], bool]) -> int:
    """The least k in [lo, hi] with passes(k), for a `passes` monotone in k (False then True) that holds at hi:
    a bisection asking at most ceil(log2(hi - lo + 1)) times."""
    while lo < hi:
        mid = (lo + hi) // 2
        if passes(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
