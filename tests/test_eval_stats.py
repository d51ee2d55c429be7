"""Paired statistics on constructed answer sets with known results (lm-eval.md section 8)."""

import math

import numpy as np
import pytest

from evals import stats


def answer_sets(n: int, both: int, baseline_only: int, candidate_only: int):
    """0/1 scores for n questions: `both` right in both arms, then the discordant ones, the rest wrong."""
    base = np.zeros(n)
    cand = np.zeros(n)
    base[:both] = cand[:both] = 1
    base[both:both + baseline_only] = 1
    cand[both + baseline_only:both + baseline_only + candidate_only] = 1
    return base, cand


def test_exact_mcnemar_known_values():
    assert stats.mcnemar_exact(2, 0) == pytest.approx(0.5)
    assert stats.mcnemar_exact(0, 2) == pytest.approx(0.5)
    assert stats.mcnemar_exact(0, 0) == 1.0
    # b=10, c=2: 2 * P(X <= 2), X ~ Bin(12, 1/2) = 2 * (1 + 12 + 66) / 4096
    assert stats.mcnemar_exact(10, 2) == pytest.approx(2 * 79 / 4096)
    assert stats.mcnemar_exact(5, 5) == pytest.approx(1.0)


@pytest.mark.parametrize("b, c, expected_se", [(2, 0, 0.0071), (3, 1, 0.0100), (5, 3, 0.0142)])
def test_paired_stderr_matches_worked_example(b, c, expected_se):
    # lm-eval.md 8.3: GSM8K n = 200 with a 2-question deficit.
    base, cand = answer_sets(200, 190, b, c)
    se = stats.paired_stderr(base, cand)
    assert se == pytest.approx(expected_se, abs=5e-5)
    n = 200
    assert se == pytest.approx(math.sqrt((b + c) - (b - c) ** 2 / n) / math.sqrt(n * (n - 1)))


def test_accuracy_stderr_is_lm_evals():
    # 193 / 200 = 0.965 -> 0.0130 (the published "0.965 ± 0.013").
    base, _ = answer_sets(200, 193, 0, 0)
    assert stats.accuracy_stderr(base) == pytest.approx(math.sqrt(0.965 * 0.035 / 199))
    assert round(stats.accuracy_stderr(base), 4) == 0.0130


def test_bootstrap_close_to_normal_approximation_for_large_n():
    base, cand = answer_sets(4000, 3000, 120, 80)
    low, high = stats.paired_bootstrap_ci(base, cand, iterations=4000, seed=1)
    d = (cand - base).mean()
    se = stats.paired_stderr(base, cand)
    assert d == pytest.approx(-0.01)
    assert low == pytest.approx(d - 1.96 * se, abs=0.15 * 1.96 * se)
    assert high == pytest.approx(d + 1.96 * se, abs=0.15 * 1.96 * se)


def test_bootstrap_is_seeded():
    base, cand = answer_sets(200, 150, 9, 3)
    assert stats.paired_bootstrap_ci(base, cand, seed=3) == stats.paired_bootstrap_ci(base, cand, seed=3)


def test_identical_answers_give_a_zero_interval_and_pass():
    base, cand = answer_sets(100, 80, 0, 0)
    result = stats.compare(base, cand, margin=0.02, iterations=500)
    assert (result.ci_low, result.ci_high) == (0.0, 0.0)
    assert result.mcnemar_p == 1.0
    assert result.verdict == stats.PASS


def test_verdict_rule():
    assert stats.verdict((-0.019, 0.01), 0.02) == stats.PASS
    assert stats.verdict((-0.03, 0.01), 0.02) == stats.INCONCLUSIVE
    assert stats.verdict((-0.2, -0.021), 0.02) == stats.FAIL
    assert stats.combine_verdicts(["pass", "inconclusive"]) == "inconclusive"
    assert stats.combine_verdicts(["pass", "fail", "inconclusive"]) == "fail"
    assert stats.combine_verdicts(["pass", "pass"]) == "pass"


def test_large_deficit_fails_and_small_sample_is_inconclusive():
    base, cand = answer_sets(200, 100, 60, 0)  # candidate loses 30 points
    result = stats.compare(base, cand, margin=0.02, iterations=2000)
    assert result.verdict == stats.FAIL
    assert (result.baseline_only_correct, result.candidate_only_correct) == (60, 0)
    assert result.mcnemar_p < 1e-15
    base, cand = answer_sets(30, 20, 2, 1)  # a 1-question deficit on 30 questions: CI far wider than 2 points
    assert stats.compare(base, cand, margin=0.02, iterations=2000).verdict == stats.INCONCLUSIVE


def test_seed_averaged_scores_use_questions_as_the_unit():
    # Two seeds per question, averaged: per-question scores in {0, 0.5, 1}.
    base = np.array([1.0, 1.0, 0.5, 0.0, 1.0, 0.5])
    cand = np.array([1.0, 0.5, 0.5, 0.5, 0.0, 1.0])
    result = stats.compare(base, cand, margin=0.02, samples_per_question=2, iterations=1000)
    assert result.n_questions == 6
    assert result.difference == pytest.approx((cand - base).mean())
    # Sign test: baseline higher on questions 1 and 4, candidate higher on 3 and 5.
    assert (result.baseline_only_correct, result.candidate_only_correct) == (2, 2)
    assert result.mcnemar_p == pytest.approx(1.0)
    assert result.difference_stderr == pytest.approx((cand - base).std(ddof=1) / math.sqrt(6))
