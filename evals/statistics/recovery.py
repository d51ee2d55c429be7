"""Recovery: candidate accuracy ÷ baseline accuracy, with a score interval for the ratio of two paired proportions.

Release cards report "recovery" (AMD's model cards: e.g. 99.3% GSM8K of the base model's score). Both arms answer the
same questions, so the two accuracies are paired proportions and their ratio needs a paired interval, not the ratio
of two independent binomial intervals. The interval here inverts the score test of H0: p_cand / p_base = theta with
the cell probabilities at their maximum-likelihood estimate under H0 (the asymptotic score interval for the ratio of
paired proportions of Nam & Blackwelder 2002, "Analysis of the ratio of marginal probabilities in a matched-pair
setting", Statistics in Medicine 21:689-699, and Tang, Tang & Chan 2003, "On tests of equivalence via non-unity
relative risk for matched-pair design", Statistics in Medicine 22:1217-1233), the ratio counterpart of the Tango
interval the difference uses (paired_interval.py). Like Tango's, it stays informative when no question is
discordant.

Cells, per question: both arms right (n11), only the candidate (n10), only the baseline (n01), neither (n00). With
several seeds per question the scores are seed means in [0, 1]; each question then contributes min(c, b) to n11,
(c - b)+ to n10, (b - c)+ to n01 and 1 - max(c, b) to n00, so the question stays the unit (as for the difference).

Under H0 the numerator S = (n11 + n10) - theta (n11 + n01) has mean 0 and variance
n [p11 (1 - theta)^2 + p10 + p01 theta^2]; the constrained MLE maximises the multinomial likelihood subject to
p11 + p10 = theta (p11 + p01), a concave problem over a segment's worth of free parameters, solved here exactly in
one dimension (the likelihood restricted to the constraint is concave in p01 once p11 is profiled out).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import brentq, minimize_scalar
from scipy.stats import norm

METHOD = "score interval for the ratio of paired proportions (Nam & Blackwelder 2002; Tang, Tang & Chan 2003)"
EPS = 1e-12


@dataclass(frozen=True)
class Recovery:
    """Candidate accuracy as a fraction of the baseline's, with its two-sided interval."""

    ratio: float | None
    ci_low: float | None
    ci_high: float | None
    level: float
    method: str = METHOD

    def to_dict(self) -> dict:
        return asdict(self)


def cells(baseline, candidate) -> tuple[float, float, float, float]:
    """(n11, n10, n01, n00) from per-question scores in [0, 1] (see the module docstring)."""
    b = np.asarray(baseline, dtype=float)
    c = np.asarray(candidate, dtype=float)
    both = np.minimum(b, c)
    return (float(both.sum()), float(np.clip(c - b, 0, None).sum()), float(np.clip(b - c, 0, None).sum()),
            float((1 - np.maximum(b, c)).sum()))


def _loglik(counts, probs) -> float:
    total = 0.0
    for k, p in zip(counts, probs):
        if k > 0:
            total += k * math.log(max(p, EPS))
    return total


def constrained_mle(n11: float, n10: float, n01: float, n00: float, theta: float) -> tuple[float, ...]:
    """(p11, p10, p01, p00) maximising the likelihood subject to p11 + p10 = theta (p11 + p01).

    Interior optimum (the usual case): the Lagrange conditions give p_ij = n_ij / (n + mu a_ij) with
    a = (1 - theta, 1, -theta, 0) for (11, 10, 01, 00), and mu the root of sum a_ij p_ij = 0, which is decreasing
    in mu. When the optimum sits on the boundary (a cell with no count but positive probability, e.g. no
    discordant question at theta != 1) there is no such root and the search below solves it."""
    closed = _lagrange_mle(n11, n10, n01, n00, theta)
    return closed if closed is not None else search_mle(n11, n10, n01, n00, theta)


def _lagrange_mle(n11: float, n10: float, n01: float, n00: float, theta: float) -> tuple[float, ...] | None:
    n = n11 + n10 + n01 + n00
    counts, a = (n11, n10, n01, n00), (1 - theta, 1.0, -theta, 0.0)
    lo, hi = -math.inf, math.inf
    for k, ai in zip(counts, a):  # every cell with a count keeps a positive denominator n + mu a
        if k > 0 and ai > 0:
            lo = max(lo, -n / ai)
        elif k > 0 and ai < 0:
            hi = min(hi, n / -ai)
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi - lo <= 0:
        return None
    h = lambda mu: sum(ai * k / (n + mu * ai) for k, ai in zip(counts, a) if k > 0)  # noqa: E731
    span = hi - lo
    left, right = lo + span * 1e-15 + EPS, hi - span * 1e-15 - EPS
    if not (h(left) > 0 > h(right)):
        return None
    mu = brentq(h, left, right, xtol=1e-14, rtol=4 * np.finfo(float).eps, maxiter=500)
    if any(k == 0 and n + mu * ai < 0 for k, ai in zip(counts, a)):
        return None  # KKT fails for an empty cell: raising its probability from 0 gains; the optimum is elsewhere
    return tuple(k / (n + mu * ai) if k > 0 else 0.0 for k, ai in zip(counts, a))


def search_mle(n11: float, n10: float, n01: float, n00: float, theta: float) -> tuple[float, ...]:
    """The constrained MLE by search (any optimum, boundary ones included).

    For a fixed p01 the constraint fixes p10 = (theta - 1) p11 + theta p01 and the likelihood is concave in p11 on
    the interval where every cell is in [0, 1]; profiling p11 out leaves a concave function of p01. Both are
    maximised by bounded scalar searches (the problem is small; exactness matters more than speed)."""
    def cells_for(p11: float, p01: float) -> tuple[float, float, float, float]:
        p10 = (theta - 1) * p11 + theta * p01
        return p11, p10, p01, 1 - p11 - p10 - p01

    def p11_range(p01: float) -> tuple[float, float]:
        # p10 >= 0: (theta - 1) p11 >= -theta p01;  p00 >= 0: theta p11 <= 1 - (1 + theta) p01
        hi = (1 - (1 + theta) * p01) / theta
        lo = 0.0
        if theta < 1:
            hi = min(hi, theta * p01 / (1 - theta)) if p01 > 0 else 0.0
        return lo, max(lo, hi)

    def best_p11(p01: float) -> tuple[float, float]:
        lo, hi = p11_range(p01)
        if hi - lo < EPS:
            return lo, _loglik((n11, n10, n01, n00), cells_for(lo, p01))
        res = minimize_scalar(lambda p: -_loglik((n11, n10, n01, n00), cells_for(p, p01)), bounds=(lo, hi),
                              method="bounded", options={"xatol": 1e-13})
        return float(res.x), -float(res.fun)

    p01_max = 1 / (1 + theta)
    res = minimize_scalar(lambda q: -best_p11(q)[1], bounds=(0.0, p01_max), method="bounded",
                          options={"xatol": 1e-13})
    p01 = float(res.x)
    p11, _ = best_p11(p01)
    return cells_for(p11, p01)


def score_statistic(n11: float, n10: float, n01: float, n00: float, theta: float) -> float:
    """The score Z for H0: ratio = theta (decreasing in theta)."""
    n = n11 + n10 + n01 + n00
    p11, p10, p01, _ = constrained_mle(n11, n10, n01, n00, theta)
    numerator = (n11 + n10) - theta * (n11 + n01)
    variance = n * (p11 * (1 - theta) ** 2 + max(p10, 0.0) + p01 * theta * theta)
    if variance <= 0:
        return math.copysign(math.inf, numerator) if numerator else 0.0
    return numerator / math.sqrt(variance)


def recovery(baseline, candidate, level: float = 0.95) -> Recovery:
    """Candidate accuracy ÷ baseline accuracy over the same questions, with the `level` score interval; the ratio
    is undefined (None) when the baseline got nothing right."""
    n11, n10, n01, n00 = cells(baseline, candidate)
    if n11 + n01 <= 0:
        return Recovery(None, None, None, level)
    ratio = (n11 + n10) / (n11 + n01)
    z = norm.ppf(0.5 + level / 2)

    def f(log_theta: float, target: float) -> float:
        return score_statistic(n11, n10, n01, n00, math.exp(log_theta)) - target

    def bound(target: float, lo: float, hi: float) -> float:
        if f(lo, target) * f(hi, target) > 0:
            return lo if abs(f(lo, target)) < abs(f(hi, target)) else hi
        return brentq(lambda t: f(t, target), lo, hi, xtol=1e-9)

    centre = math.log(ratio) if ratio > 0 else -20.0
    low = 0.0 if ratio <= 0 else math.exp(bound(z, -20.0, centre))
    high = math.exp(bound(-z, centre, 20.0))
    return Recovery(float(ratio), float(low), float(high), level)
