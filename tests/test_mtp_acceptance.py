"""MTP draft acceptance: the simulation's arithmetic, the one-pass chained drafts against recomputing every chain
from scratch, and the in-process draft of every family we ship with MTP layers (GLM-5, DeepSeek-V3, Qwen3.5)
through `quant eval`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

import pytest
import torch

from evals.statistics.acceptance import compare_acceptance, simulate

FIXTURE = Path(__file__).parent.parent / "evals" / "data" / "toy_arith" / "model"


def test_simulate_counts_rounds_like_greedy_verification():
    # prompt of 3 tokens, generation x[3..9]; target_next[t] predicts x[t+1]; last anchor = L-2 = 8.
    target_next = np.array([0, 0, 5, 6, 7, 8, 9, 10, 11, 12])
    drafts = np.full((2, 10), -1)
    drafts[0, 3:9] = [6, 7, 0, 9, 10, 0]    # anchor c drafts x[c+1] (= target_next[c]): right at 3, 4, 6, 7
    drafts[1, 3:9] = [7, 0, 0, 10, 0, 0]    # its second draft x[c+2] (= target_next[c+1]): right at 3 and 6
    q = simulate(target_next, drafts, start=3, depth=2)
    # anchors 3..8; depth-1 right at 3, 4, 6, 7
    assert (q.positions, q.accepted_depth1) == (6, 4)
    # round at 3: d1, d2 accepted -> 3 tokens, next anchor 6; at 6: d1, d2 accepted -> capped at the end (3 tokens)
    assert (q.rounds, q.tokens) == (2, 6)
    none = simulate(target_next, np.full((2, 10), -1), start=3, depth=2)
    assert (none.accepted_depth1, none.rounds, none.tokens) == (0, 6, 6)  # one token per round


def test_paired_acceptance_verdicts():
    good = [{"positions": 20, "accepted_depth1": 19, "rounds": 6, "tokens": 20, "depth": 3}] * 50
    same = compare_acceptance(good, good, margin=0.05)
    assert same.verdict == "pass" and same.rate_difference == 0
    bad = [{"positions": 20, "accepted_depth1": 2, "rounds": 18, "tokens": 20, "depth": 3}] * 50
    worse = compare_acceptance(good, bad, margin=0.05)
    assert worse.verdict == "fail" and worse.rate_ci_high < -0.05
    assert worse.candidate_length == pytest.approx(20 / 18)


def _brute_force_chains(draft, ids, hidden, start, depth):
    """Every chain recomputed from scratch over its own full sequence (no mask tricks)."""
    length = ids.shape[1]
    out = np.full((depth, length), -1)
    positions = torch.arange(length - 1)[None]
    states, logits = draft(0, ids[:, 1:], hidden[:, :-1], positions)
    first = logits[0].argmax(-1)
    out[0, 1:] = first.numpy()
    for c in range(start, length - 1):
        tokens, hiddens = [first[c - 1]], [states[0, c - 1]]
        for step in range(1, depth):
            t = torch.cat([ids[0, 1:c + 1], torch.stack(tokens)])[None]
            h = torch.cat([hidden[0, :c], torch.stack(hiddens)])[None]
            o, lg = draft(step, t, h, torch.arange(t.shape[1])[None])
            tokens.append(lg[0, -1].argmax(-1))
            hiddens.append(o[0, -1])
            out[step, c] = int(tokens[-1])
    return out


def test_one_pass_chains_equal_recomputed_chains():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evals.arms.mtp_draft import load_draft
    from evals.arms.mtp_measure import draft_chains, extend_chains, target_pass

    model = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(FIXTURE)
    draft = load_draft(FIXTURE, dtype=torch.float32)
    rows = [json.loads(line) for line in (FIXTURE.parent / "test.jsonl").read_text().splitlines()[:2]]
    for row in rows:
        prompt = tokenizer.encode(f"Question: {row['question']}\nAnswer:")
        generated = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0].tolist()
        ids = torch.tensor([generated])
        with torch.no_grad():
            hidden, target_next = target_pass(model, ids)
            drafts, state = draft_chains(draft, ids, hidden, len(prompt), 3)
            extend_chains(draft, drafts, state, target_next.numpy(), 3)
            reference = _brute_force_chains(draft, ids, hidden, len(prompt), 3)
        computed = drafts != -1
        assert computed[0, len(prompt):].all() and computed[1:].any()
        assert (drafts[computed] == reference[computed]).all()


@pytest.mark.parametrize("family", ["glm5", "deepseek-v3", "qwen3.5"])
def test_every_mtp_family_gets_paired_acceptance_in_process(toy_factory, tmp_path, family):
    """The toy of each family with MTP layers (random weights, so acceptance is near zero: the point is that it
    is measured, through that family's MTP layout) against its MXFP4 export, through `quant eval`."""
    from evals.compare import EvalRequest, evaluate
    from quant.pipeline import quantize_checkpoint

    toy = toy_factory(family)
    export = tmp_path / "mxfp4"
    quantize_checkpoint(toy, export, check_engines=None, log=lambda m: None)
    report = evaluate(EvalRequest(candidate=str(export), baseline=str(toy), tasks="toy_arith", limit=4,
                                  max_gen_toks=8, margin=50.0, out=tmp_path / "eval", dtype="float32"),
                      log=lambda m: None).to_json()
    for arm in ("baseline", "candidate"):
        assert report[arm]["mtp"]["measured"], report[arm]["mtp"]
    acceptance = next(r for r in report["rows"] if r["primary"])["acceptance"]
    assert acceptance["n_questions"] == 4 and acceptance["depth"] == 3
    assert 0 <= acceptance["baseline_rate"] <= 1 and acceptance["baseline_length"] >= 1


def test_a_family_without_mtp_says_so(toy_factory, tmp_path):
    from evals.compare import EvalRequest, evaluate

    toy = toy_factory("qwen3-moe")
    twin = tmp_path / "twin"  # the same weights elsewhere, one file more: a byte-identical copy is refused
    shutil.copytree(toy, twin)
    (twin / "NOTES.md").write_text("another checkpoint directory\n")
    report = evaluate(EvalRequest(candidate=str(toy), baseline=str(twin), tasks="toy_arith", limit=2, max_gen_toks=4,
                                  margin=50.0, out=tmp_path / "eval", dtype="float32"),
                      log=lambda m: None).to_json()
    assert report["candidate"]["mtp"] == {"measured": False, "why": "the checkpoint has no MTP layers"}
    assert next(r for r in report["rows"] if r["primary"])["acceptance"] is None
    assert "not measured (the checkpoint has no MTP layers)" in (tmp_path / "eval" / "report.md").read_text()


def test_mtp_off_runs_without_the_draft(tmp_path):
    """`quant eval --no-mtp` on a checkpoint that has an MTP layer: the arms run without loading the draft (this
    path once crashed unpacking the loader's result)."""
    from evals.compare import EvalRequest, evaluate

    twin = tmp_path / "twin"
    shutil.copytree(FIXTURE, twin)
    (twin / "NOTES.md").write_text("another checkpoint directory\n")  # a byte-identical copy would be refused
    report = evaluate(EvalRequest(candidate=str(FIXTURE), baseline=str(twin), tasks="toy_arith", limit=2,
                                  max_gen_toks=4, margin=50.0, out=tmp_path / "eval", mtp=False),
                      log=lambda m: None).to_json()
    assert report["candidate"]["mtp"]["measured"] is False and "--mtp off" in report["candidate"]["mtp"]["why"]
    assert next(r for r in report["rows"] if r["primary"])["acceptance"] is None
