"""Recovery (candidate ÷ baseline accuracy) and its score interval for the ratio of paired proportions
(evals/statistics/recovery.py): the closed-form constrained MLE against a search, the interval's coverage by
simulation, and its behaviour where naive intervals collapse."""

from __future__ import annotations

import random

import numpy as np
import pytest

from evals.statistics.recovery import _lagrange_mle, _loglik, recovery, score_statistic, search_mle


def arms(k11: int, k10: int, k01: int, k00: int) -> tuple[list[float], list[float]]:
    """Per-question baseline and candidate scores with the given cells (both, only candidate, only baseline,
    neither)."""
    baseline = [1.0] * k11 + [0.0] * k10 + [1.0] * k01 + [0.0] * k00
    candidate = [1.0] * k11 + [1.0] * k10 + [0.0] * k01 + [0.0] * k00
    return baseline, candidate


def test_the_closed_form_mle_is_the_likelihoods_maximum():
    rng = random.Random(1)
    checked = 0
    for _ in range(300):
        counts = [rng.choice([0, rng.randint(1, 40)]) for _ in range(4)]
        if sum(counts) == 0:
            continue
        theta = rng.uniform(0.3, 2.5)
        closed = _lagrange_mle(*counts, theta)
        if closed is None:
            continue
        checked += 1
        assert abs(sum(closed) - 1) < 1e-12
        assert abs((closed[0] + closed[1]) - theta * (closed[0] + closed[2])) < 1e-12
        assert _loglik(counts, search_mle(*counts, theta)) <= _loglik(counts, closed) + 1e-9
    assert checked > 100


def test_the_estimate_is_inside_and_the_score_is_zero_there():
    baseline, candidate = arms(140, 5, 10, 45)
    r = recovery(baseline, candidate)
    assert r.ratio == pytest.approx(145 / 150)
    assert r.ci_low < r.ratio < r.ci_high
    assert abs(score_statistic(140, 5, 10, 45, r.ratio)) < 1e-9


def test_no_discordant_question_still_gives_an_interval():
    """Identical answers: the ratio is 1, and the interval is the evidence n questions give (not [1, 1])."""
    r_small = recovery(*arms(90, 0, 0, 10))
    r_large = recovery(*arms(900, 0, 0, 100))
    assert r_small.ratio == 1.0
    assert r_small.ci_low < 1 < r_small.ci_high
    assert r_large.ci_low > r_small.ci_low and r_large.ci_high < r_small.ci_high


def test_a_baseline_with_nothing_right_has_no_ratio():
    assert recovery([0.0] * 5, [1.0] * 5).ratio is None


def test_seed_averaged_scores_count_each_question_once():
    baseline = [1.0, 0.5, 1.0, 0.0]
    candidate = [1.0, 1.0, 0.5, 0.0]
    r = recovery(baseline, candidate)
    assert r.ratio == pytest.approx(2.5 / 2.5)


@pytest.mark.parametrize("cells,n", [((0.75, 0.06, 0.04, 0.15), 200), ((0.40, 0.10, 0.15, 0.35), 120)])
def test_coverage_is_near_nominal(cells, n):
    rng = np.random.default_rng(0)
    truth = (cells[0] + cells[1]) / (cells[0] + cells[2])
    sims = 400
    hits = 0
    for _ in range(sims):
        r = recovery(*arms(*rng.multinomial(n, cells)))
        hits += r.ci_low <= truth <= r.ci_high
    assert 0.92 <= hits / sims <= 0.985, hits / sims
