"""Pairing answers question by question: mismatches are errors, failures are counted and scored wrong."""

import numpy as np
import pytest

from evals.statistics.pairing import generation_counts, pair_scores
from quant.errors import QuantError


def record(doc_id, score, *, seed=0, task="gsm8k", filter_name="flexible-extract", prompt="p", response="x",
           failed=False):
    return {"task": task, "seed": seed, "filter": filter_name, "doc_id": doc_id, "doc_hash": f"d{doc_id}",
            "prompt_hash": f"{prompt}{doc_id}", "target": "1", "response": response, "extracted": "1",
            "score": float(score), "failed": failed, "empty": not response.strip()}


def test_pairs_align_by_doc_id_whatever_the_order():
    base = [record(2, 1), record(0, 0), record(1, 1)]
    cand = [record(1, 0), record(2, 1), record(0, 1)]
    paired = pair_scores(base, cand, "gsm8k", "flexible-extract")
    assert paired.doc_ids == [0, 1, 2]
    assert paired.baseline.tolist() == [0, 1, 1]
    assert paired.candidate.tolist() == [1, 0, 1]


def test_prompt_mismatch_is_a_clear_error():
    base = [record(0, 1), record(1, 1)]
    cand = [record(0, 1), record(1, 1, prompt="other")]
    with pytest.raises(QuantError, match=r"doc_id 1 .*prompt differs"):
        pair_scores(base, cand, "gsm8k", "flexible-extract")


def test_missing_question_is_a_clear_error():
    base = [record(0, 1), record(1, 1), record(2, 0)]
    cand = [record(0, 1), record(1, 1)]
    with pytest.raises(QuantError, match=r"only the baseline answered .*doc_id 2"):
        pair_scores(base, cand, "gsm8k", "flexible-extract")


def test_seeds_are_averaged_per_question():
    base = [record(d, s, seed=seed, task="gpqa_diamond") for d, s, seed in
            [(0, 1, 0), (0, 0, 1), (1, 1, 0), (1, 1, 1)]]
    cand = [record(d, s, seed=seed, task="gpqa_diamond") for d, s, seed in
            [(0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 1, 1)]]
    paired = pair_scores(base, cand, "gpqa_diamond", "flexible-extract")
    assert paired.seeds == [0, 1]
    np.testing.assert_allclose(paired.baseline, [0.5, 1.0])
    np.testing.assert_allclose(paired.candidate, [1.0, 0.5])


def test_failed_and_empty_generations_are_counted_and_wrong():
    rows = [record(0, 1), record(1, 0, response=""), record(2, 0, response="[generation failed]", failed=True),
            record(0, 1, filter_name="strict-match")]
    counts = generation_counts(rows, "gsm8k", "flexible-extract")
    assert counts.to_json() == {"generations": 3, "failed": 1, "empty": 1}
