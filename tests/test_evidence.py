"""Evidence before a verdict (evals/statistics/evidence.py) and `quant eval --out` under the ownership rule: arms at their
floor make the verdict invalid, never pass; inconclusive verdicts say what would decide them; --out never deletes
what eval did not write."""

import json
import shutil
from pathlib import Path

import eval_rows
import pytest

from evals.statistics import evidence
from evals.compare import EXIT_CODES, EvalRequest, evaluate
from quant.errors import QuantError
from quant.ownership import claim
from quant.toy import build_toy

FIXTURE = Path(__file__).parent.parent / "evals" / "data" / "toy_arith" / "model"


def _row(task="gsm8k", base=0.8, cand=0.8, verdict="pass", acceptance=None, n_to_pass=None, n=200):
    return eval_rows.row(task, acceptance=acceptance, baseline_accuracy=base, candidate_accuracy=cand,
                         verdict=verdict, n_questions=n, n_to_pass=n_to_pass)


def _acc(base=0.8, cand=0.8, verdict="pass"):
    return eval_rows.acceptance(baseline_rate=base, candidate_rate=cand, verdict=verdict,
                                verdict_on="depth-1 acceptance (points)")


def test_arms_at_their_floor_are_invalid_and_healthy_arms_are_not():
    assert evidence.floor_problems([_row()], {"gsm8k": 0.05}) == []
    problems = evidence.floor_problems([_row(base=0.005, cand=0.005)], {"gsm8k": 0.05})
    assert len(problems) == 1 and "baseline 0.5% and candidate 0.5%" in problems[0]
    # GPQA's floor is chance: 25% on four choices is no evidence of anything
    assert evidence.floor_problems([_row("gpqa_diamond", 0.26, 0.25)], {"gpqa_diamond": 0.25})
    # the draft dead in both arms (untrained MTP): acceptance cannot be compared
    problems = evidence.floor_problems([_row(acceptance=_acc(0.001, 0.001))], {"gsm8k": 0.05})
    assert len(problems) == 1 and "depth-1 acceptance" in problems[0]
    # a dead candidate draft beside a working baseline draft is the damage the check exists for: a fail, not invalid
    assert evidence.floor_problems([_row(acceptance=_acc(0.97, 0.003, "fail"))], {"gsm8k": 0.05}) == []
    # ROCm/ATOM#646: accuracy collapsed while the draft keeps agreeing: invalid and called inconsistent
    problems = evidence.floor_problems([_row(cand=0.0, acceptance=_acc(0.96, 0.966))], {"gsm8k": 0.05})
    assert any("inconsistent" in p for p in problems)


def test_a_nibble_swapped_candidate_above_the_floor_still_fails():
    """A candidate that lost most of its accuracy but is above the floor is a real regression (fail), not
    invalid: the floor is for broken setups only (the e2e nibble-swap test checks the same on real answers)."""
    assert evidence.floor_problems([_row(base=0.98, cand=0.11, verdict="fail")], {"gsm8k": 0.05}) == []


def test_every_inconclusive_verdict_says_what_would_decide_it():
    steps = evidence.next_steps([_row(verdict="inconclusive", n_to_pass=420, n=200)], 200, {"gsm8k": 1319})
    assert steps and "--limit 420" in steps[0]
    steps = evidence.next_steps([_row("gpqa_diamond", verdict="inconclusive", n_to_pass=900, n=198)], None,
                                {"gpqa_diamond": 198}, {"gpqa_diamond"})
    assert steps and "--seeds" in steps[0]
    steps = evidence.next_steps([_row(acceptance=_acc(verdict="inconclusive"))], 200, {"gsm8k": 1319})
    assert steps and "MTP" in steps[0]


def test_failed_requests_beyond_the_tolerance_are_an_error():
    from quant.errors import EvidenceMissing

    evidence.check_failures("baseline", {"failed_requests": 2, "source": "u"}, 200)  # 1%: tolerated
    with pytest.raises(EvidenceMissing, match="baseline u: 3 of 200 requests failed") as e:
        evidence.check_failures("baseline", {"failed_requests": 3, "source": "u"}, 200)
    assert e.value.exit_code == 69
    with pytest.raises(EvidenceMissing):
        evidence.check_failures("candidate", {"failed_requests": 1, "source": "u"}, 20)


@pytest.mark.slow
def test_two_untrained_toys_are_invalid_never_pass(tmp_path):
    """Two random toys both score ~0: the paired interval is tight around 0 and would pass; the floor says the
    comparison is not evidence (exit 4), and their dead drafts are not compared either."""
    a = build_toy("glm5", tmp_path / "a", seed=0)
    b = build_toy("glm5", tmp_path / "b", seed=1)
    report = evaluate(EvalRequest(candidate=str(a), baseline=str(b), out=tmp_path / "out", tasks="toy_arith",
                                  limit=30, max_gen_toks=8, dtype="float32", margin=5.0), log=lambda m: None).to_json()
    assert report["verdict"] == "invalid" and report["exit_code"] == EXIT_CODES["invalid"] == 4
    assert any("floor" in p for p in report["problems"])
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["verdict"] == "invalid"


def _request(tmp_path, out, **kw):
    return EvalRequest(candidate=str(kw.pop("candidate", FIXTURE)), baseline=str(kw.pop("baseline", FIXTURE)),
                       out=out, tasks="toy_arith", limit=4, max_gen_toks=8, **kw)


def test_eval_out_refuses_a_foreign_directory_and_keeps_its_files(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("a user's file")
    (out / "runs").mkdir()
    (out / "runs" / "keep.txt").write_text("also the user's")
    shutil.copytree(FIXTURE, tmp_path / "base")
    with pytest.raises(QuantError, match="not an output of this tool.*--overwrite") as e:
        evaluate(_request(tmp_path, out, baseline=tmp_path / "base"), log=lambda m: None)
    assert e.value.exit_code == 2
    assert (out / "notes.txt").read_text() == "a user's file" and (out / "runs" / "keep.txt").exists()


def test_eval_out_refuses_to_hold_its_own_inputs(tmp_path):
    out = tmp_path / "out"
    cand = out / "work" / "ckpt"
    shutil.copytree(FIXTURE, cand)
    with pytest.raises(QuantError, match="must not be the candidate .* or inside it|contains the candidate"):
        evaluate(_request(tmp_path, out, candidate=cand), log=lambda m: None)
    assert (cand / "config.json").is_file()  # the checkpoint it was asked to evaluate is still there
    data = out / "data"
    data.mkdir()
    shutil.copytree(FIXTURE, tmp_path / "base")
    with pytest.raises(QuantError, match="contains the --data-dir"):
        evaluate(_request(tmp_path, out, candidate=tmp_path / "base", data_dir=data), log=lambda m: None)


def test_a_second_eval_into_the_same_out_is_refused_while_the_first_runs(tmp_path):
    out = tmp_path / "out"
    shutil.copytree(FIXTURE, tmp_path / "base")
    with claim(out, "eval"):
        with pytest.raises(QuantError, match="another quant command is writing into this directory"):
            evaluate(_request(tmp_path, out, baseline=tmp_path / "base"), log=lambda m: None)
