"""Paired statistics on constructed answer sets with known results."""

import math

import numpy as np
import pytest

from evals.statistics import accuracy
from evals.statistics.paired_interval import tango_interval


def answer_sets(n: int, both: int, baseline_only: int, candidate_only: int):
    """0/1 scores for n questions: `both` right in both arms, then the discordant ones, the rest wrong."""
    base = np.zeros(n)
    cand = np.zeros(n)
    base[:both] = cand[:both] = 1
    base[both:both + baseline_only] = 1
    cand[both + baseline_only:both + baseline_only + candidate_only] = 1
    return base, cand


def test_exact_mcnemar_known_values():
    assert accuracy.mcnemar_exact(2, 0) == pytest.approx(0.5)
    assert accuracy.mcnemar_exact(0, 2) == pytest.approx(0.5)
    assert accuracy.mcnemar_exact(0, 0) == 1.0
    # b=10, c=2: 2 * P(X <= 2), X ~ Bin(12, 1/2) = 2 * (1 + 12 + 66) / 4096
    assert accuracy.mcnemar_exact(10, 2) == pytest.approx(2 * 79 / 4096)
    assert accuracy.mcnemar_exact(5, 5) == pytest.approx(1.0)


@pytest.mark.parametrize("b, c, expected_se", [(2, 0, 0.0071), (3, 1, 0.0100), (5, 3, 0.0142)])
def test_paired_stderr_matches_worked_example(b, c, expected_se):
    # Worked example: GSM8K n = 200 with a 2-question deficit.
    base, cand = answer_sets(200, 190, b, c)
    se = accuracy.paired_stderr(base, cand)
    assert se == pytest.approx(expected_se, abs=5e-5)
    n = 200
    assert se == pytest.approx(math.sqrt((b + c) - (b - c) ** 2 / n) / math.sqrt(n * (n - 1)))


def test_accuracy_stderr_is_lm_evals():
    # 193 / 200 = 0.965 -> 0.0130 (the published "0.965 ± 0.013").
    base, _ = answer_sets(200, 193, 0, 0)
    assert accuracy.accuracy_stderr(base) == pytest.approx(math.sqrt(0.965 * 0.035 / 199))
    assert round(accuracy.accuracy_stderr(base), 4) == 0.0130


def test_score_interval_is_close_to_wald_for_large_n():
    base, cand = answer_sets(4000, 3000, 120, 80)
    result = accuracy.compare(base, cand, margin=0.02)
    d, se = result.difference, accuracy.paired_stderr(base, cand)
    assert d == pytest.approx(-0.01)
    assert result.ci_low == pytest.approx(d - 1.96 * se, abs=0.05 * 1.96 * se)
    assert result.ci_high == pytest.approx(d + 1.96 * se, abs=0.05 * 1.96 * se)


def test_score_interval_bounds_solve_the_score_equation_with_an_independently_fitted_nuisance():
    """The bounds are where Tango's Z equals -+1.96, with the constrained MLE checked against a numerical
    maximisation of the multinomial likelihood (not the closed form the module uses)."""
    from scipy.optimize import minimize_scalar

    x, y, n = 7.0, 3.0, 60.0
    low, high = tango_interval(x, y, n)
    for delta0, target in ((low, 1.959964), (high, -1.959964)):
        m = n - x - y

        def neg_loglik(t):
            return -(x * math.log(t + delta0) + y * math.log(t) + m * math.log(1 - 2 * t - delta0))

        lo_t = max(1e-12, -delta0 + 1e-12)
        t_hat = minimize_scalar(neg_loglik, bounds=(lo_t, (1 - delta0) / 2 - 1e-12), method="bounded",
                                options={"xatol": 1e-12}).x
        z = ((x - y) / n - delta0) / math.sqrt((2 * t_hat + delta0 - delta0 ** 2) / n)
        assert z == pytest.approx(target, abs=1e-3)


def test_no_discordant_pair_is_not_a_zero_width_interval():
    # b = c = 0: the bound is 3.84 / (n + 3.84), the score-test rule of three.
    for n in (4, 100, 188, 189):
        base, cand = answer_sets(n, n // 2, 0, 0)
        result = accuracy.compare(base, cand, margin=0.02)
        bound = 1.959964 ** 2 / (n + 1.959964 ** 2)
        assert (result.ci_low, result.ci_high) == (pytest.approx(-bound, rel=1e-4), pytest.approx(bound, rel=1e-4))
        assert result.verdict == (accuracy.PASS if n >= 189 else accuracy.INCONCLUSIVE)
    assert accuracy.compare(*answer_sets(4, 2, 0, 0), margin=0.02).n_to_pass == 189


def test_n_to_pass_follows_the_observed_discordance():
    result = accuracy.compare(*answer_sets(100, 90, 2, 3), margin=0.02)
    assert result.verdict == accuracy.INCONCLUSIVE and result.n_to_pass > 100
    k = result.n_to_pass
    assert tango_interval(3 * k / 100, 2 * k / 100, float(k))[0] > -0.02  # x = candidate-only mass
    assert tango_interval(3 * (k - 1) / 100, 2 * (k - 1) / 100, float(k - 1))[0] <= -0.02
    assert accuracy.compare(*answer_sets(100, 80, 10, 0), margin=0.02).n_to_pass is None  # observed -10 points


@pytest.mark.parametrize("n", [20, 50, 100, 200])
def test_score_interval_coverage_at_small_n(n):
    """Seeded simulation of paired binary outcomes: discordance 0-10 %, both directions; empirical coverage of
    the nominal 95 % interval must be at least 93 % in every cell (scripts/coverage_paired.py runs more)."""
    rng = np.random.default_rng(n)
    sims = 400
    for rate in (0.0, 0.02, 0.05, 0.1):
        for share in (0.2, 0.5, 0.8):  # fraction of the discordance that favours the candidate
            px, py = rate * share, rate * (1 - share)
            counts = rng.multinomial(n, [px, py, 1 - px - py], size=sims)
            hits = sum(lo <= px - py <= hi for lo, hi in (tango_interval(float(x), float(y), float(n))
                                                          for x, y, _ in counts))
            assert hits / sims >= 0.93, (n, rate, share, hits / sims)


def test_verdict_rule():
    assert accuracy.verdict((-0.019, 0.01), 0.02) == accuracy.PASS
    assert accuracy.verdict((-0.03, 0.01), 0.02) == accuracy.INCONCLUSIVE
    assert accuracy.verdict((-0.2, -0.021), 0.02) == accuracy.FAIL
    assert accuracy.combine_verdicts(["pass", "inconclusive"]) == "inconclusive"
    assert accuracy.combine_verdicts(["pass", "fail", "inconclusive"]) == "fail"
    assert accuracy.combine_verdicts(["pass", "pass"]) == "pass"


def test_large_deficit_fails_and_small_sample_is_inconclusive():
    base, cand = answer_sets(200, 100, 60, 0)  # candidate loses 30 points
    result = accuracy.compare(base, cand, margin=0.02)
    assert result.verdict == accuracy.FAIL
    assert (result.baseline_only_correct, result.candidate_only_correct) == (60, 0)
    assert result.mcnemar_p < 1e-15
    base, cand = answer_sets(30, 20, 2, 1)  # a 1-question deficit on 30 questions: CI far wider than 2 points
    assert accuracy.compare(base, cand, margin=0.02).verdict == accuracy.INCONCLUSIVE


def test_seed_averaged_scores_use_questions_as_the_unit():
    # Two seeds per question, averaged: per-question scores in {0, 0.5, 1}.
    base = np.array([1.0, 1.0, 0.5, 0.0, 1.0, 0.5])
    cand = np.array([1.0, 0.5, 0.5, 0.5, 0.0, 1.0])
    result = accuracy.compare(base, cand, margin=0.02, samples_per_question=2)
    assert result.n_questions == 6
    assert result.difference == pytest.approx((cand - base).mean())
    # Sign test: baseline higher on questions 1 and 4, candidate higher on 3 and 5.
    assert (result.baseline_only_correct, result.candidate_only_correct) == (2, 2)
    assert result.mcnemar_p == pytest.approx(1.0)
    assert result.difference_stderr == pytest.approx((cand - base).std(ddof=1) / math.sqrt(6))
    # Discordance mass: candidate 0.5 + 0.5 = 1.0, baseline 0.5 + 1 = 1.5 (questions, not seeds, are the unit).
    assert (result.ci_low, result.ci_high) == tango_interval(1.0, 1.5, 6.0)


def test_seed_averaged_interval_does_not_collapse_when_every_difference_is_zero():
    scores = np.array([1.0, 0.5, 0.0, 1.0] * 25)
    result = accuracy.compare(scores, scores.copy(), margin=0.02, samples_per_question=2)
    assert result.ci_high - result.ci_low > 0.05 and result.verdict == accuracy.INCONCLUSIVE


def test_accuracy_stderr_is_lm_evals_own_to_the_last_bit():
    """The statistics layer imports no lm-eval; its standard error must still be lm-eval's figure exactly."""
    import random

    from lm_eval.api.metrics import mean_stderr

    rng = random.Random(0)
    for n in (2, 3, 17, 200, 1319):
        scores = [rng.choice([0.0, 1.0, 0.5, 1 / 3]) for _ in range(n)]
        assert accuracy.accuracy_stderr(scores) == mean_stderr(scores)
