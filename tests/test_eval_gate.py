"""CI gates as files (evals/gate.py): vLLM's GSM8K config format read strictly, applied as vLLM's test applies it
(accuracy >= accuracy_threshold - tolerance; mean acceptance length >= min_acceptance_length), and written back
from a baseline run."""

from __future__ import annotations

import re

import eval_rows
import pytest
import yaml

from evals.gate import apply_gate, check_run, gate_from_baseline, read_gate, write_gate
from evals.statistics.results import EvalReport
from evals.tasks.registry import registry
from quant.errors import QuantError

# The fields of vLLM's tests/evals/gsm8k/configs/DeepSeek-V4.1-Flash-NVFP4-DSpark-TP4.yaml, as it has them.
VLLM_CONFIG = """model_name: "nvidia/DeepSeek-V4.1-Flash-NVFP4"
accuracy_threshold: 0.88
tolerance: 0.03
min_acceptance_length: 2.5
num_questions: 1319
num_fewshot: 5
startup_max_wait_seconds: 1800
server_args: >-
  --max-model-len 8192
  --tensor-parallel-size 4
"""


def report(candidate_accuracy: float, candidate_length: float | None = 3.1, baseline_accuracy: float = 0.9,
           n: int = 1319, task: str = "gsm8k") -> EvalReport:
    acceptance = None if candidate_length is None else \
        eval_rows.acceptance(candidate_length=candidate_length, baseline_length=3.2)
    return eval_rows.report([
        eval_rows.row(task, acceptance=acceptance, candidate_accuracy=candidate_accuracy,
                      baseline_accuracy=baseline_accuracy, n_questions=n),
        eval_rows.row(task, primary=False, candidate_accuracy=0.0, baseline_accuracy=0.0, n_questions=n),
    ], candidate={"name": "cand"})


def gate_file(tmp_path, text: str = VLLM_CONFIG):
    path = tmp_path / "gate.yaml"
    path.write_text(text)
    return path


def test_vllms_own_config_reads_and_gates_as_its_test_does(tmp_path):
    gate = read_gate(gate_file(tmp_path))
    assert (gate.accuracy_threshold, gate.tolerance, gate.min_acceptance_length) == (0.88, 0.03, 2.5)
    assert gate.carried["startup_max_wait_seconds"] == 1800
    assert apply_gate(gate, report(0.85))["passed"]          # 0.85 >= 0.88 - 0.03
    below = apply_gate(gate, report(0.8499))
    assert not below["passed"] and below["checks"][0]["check"] == "accuracy"
    slow_draft = apply_gate(gate, report(0.95, candidate_length=2.4))
    assert not slow_draft["passed"] and [c["passed"] for c in slow_draft["checks"]] == [True, False]
    no_draft = apply_gate(gate, report(0.95, candidate_length=None))
    assert not no_draft["passed"] and "not measured" in no_draft["checks"][1]["rule"]


def test_the_default_tolerance_is_vllms(tmp_path):
    gate = read_gate(gate_file(tmp_path, "accuracy_threshold: 0.5\n"))
    assert gate.tolerance == 0.08 and apply_gate(gate, report(0.42))["passed"]


@pytest.mark.parametrize("text,phrase", [
    ("accuracy_treshold: 0.5\n", "accuracy_treshold: unknown key; did you mean 'accuracy_threshold'"),
    ("accuracy_threshold: 0.5\nmax_model_len: 4096\n", "max_model_len: unknown key"),
    ("tolerance: 0.1\n", "accuracy_threshold is missing"),
    ("accuracy_threshold: high\n", "is not a float"),
    ("accuracy_threshold: 88\n", "accuracy_threshold: 88 is outside [0, 1]"),
    ("accuracy_threshold: 0.5\ntolerance: -0.1\n", "tolerance: -0.1 is outside [0, 1]"),
    # PyYAML keeps the last of two equal keys silently: which one was meant is not known
    ("accuracy_threshold: 0.9\ntolerance: 0.03\naccuracy_threshold: 0.5\n",
     "accuracy_threshold: given twice (lines 1 and 3)"),
    ("{accuracy_threshold: 0.9, accuracy_threshold: 0.5}\n", "accuracy_threshold: given twice"),
    ("accuracy_threshold: 0.5\nenv:\n  VLLM_USE_V1: '1'\n  VLLM_USE_V1: '0'\n", "VLLM_USE_V1: given twice"),
    # values no gate can mean
    ("accuracy_threshold: 0.5\nmin_acceptance_length: -1\n", "min_acceptance_length: -1 is outside [1, 65]"),
    ("accuracy_threshold: 0.5\nmin_acceptance_length: 0.8\n", "min_acceptance_length: 0.8 is outside [1, 65]"),
    ("accuracy_threshold: 0.5\nmin_acceptance_length: 250\n", "min_acceptance_length: 250 is outside [1, 65]"),
    ("accuracy_threshold: 0.5\nnum_questions: 0\n", "num_questions: 0 is below 1"),
    ("accuracy_threshold: 0.5\nnum_fewshot: -5\n", "num_fewshot: -5 is below 0"),
    ("accuracy_threshold: 0.5\nstartup_max_wait_seconds: -1\n", "startup_max_wait_seconds: -1 is below 0"),
    ("- 1\n", "not a mapping")])
def test_a_bad_gate_file_is_one_line_naming_the_key(tmp_path, text, phrase):
    with pytest.raises(QuantError, match=re.escape(phrase)) as e:
        read_gate(gate_file(tmp_path, text))
    assert e.value.exit_code == 2 and "gate.yaml" in str(e.value)


@pytest.mark.parametrize("text,key", [("accuracy_threshold: 0.9\naccuracy_threshold: 0.5\n", "accuracy_threshold"),
                                      ("accuracy_threshold: 0.5\nmin_acceptance_length: -1\n", "min_acceptance_length"),
                                      ("accuracy_threshold: 0.5\nmin_acceptence_length: 2\n", "min_acceptence_length")])
def test_a_bad_gate_file_stops_quant_eval_before_any_work(tmp_path, text, key):
    """On the command line: exit 2, one line naming the file and the key, before any server is asked or --out made."""
    import os
    import subprocess
    import sys

    path = gate_file(tmp_path, text)
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "quant.cli", "eval", "--candidate", "http://127.0.0.1:9/v1",
                             "--baseline", "http://127.0.0.1:10/v1", "--tasks", "gsm8k", "--gate", str(path),
                             "--out", str(out)], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "COLUMNS": "200"})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: --gate {path}: {key}: "), lines
    assert not out.exists()


def test_a_run_that_does_not_ask_what_the_gate_was_set_for_is_refused(tmp_path):
    path = gate_file(tmp_path)
    gate = read_gate(path)
    specs = [registry()["gsm8k"]]
    check_run(gate, path, specs, limit=None, mtp=True)  # all 1,319 questions, 5-shot: what the gate says
    with pytest.raises(QuantError, match="num_questions 1319, but this run asks 200.*--limit 1319"):
        check_run(gate, path, specs, limit=200, mtp=True)
    with pytest.raises(QuantError, match="gates gsm8k, which --tasks does not run"):
        check_run(gate, path, [registry()["toy_arith"]], limit=None, mtp=True)
    with pytest.raises(QuantError, match="min_acceptance_length needs the MTP measurement"):
        check_run(gate, path, specs, limit=None, mtp=False)


def test_a_gate_written_from_a_baseline_reads_back_and_gates_the_baseline_itself(tmp_path):
    r = report(0.9, baseline_accuracy=0.91234)
    written = gate_from_baseline(r, registry()["gsm8k"], margin_points=2.0, mtp_margin_points=5.0, model_name=None)
    assert written == {"model_name": "cand", "accuracy_threshold": 0.9123, "tolerance": 0.02,
                       "num_questions": 1319, "num_fewshot": 5, "min_acceptance_length": 3.04}
    path = tmp_path / "written.yaml"
    write_gate(path, written)
    assert yaml.safe_load(path.read_text()) == written
    gate = read_gate(path)
    assert apply_gate(gate, report(0.9123 - 0.02, candidate_length=3.04))["passed"]
    assert not apply_gate(gate, report(0.9123 - 0.0201, candidate_length=3.04))["passed"]
    # A baseline draft that accepts nothing (length 1): the written minimum stays readable (at least 1).
    r = eval_rows.report([eval_rows.row("gsm8k", acceptance=eval_rows.acceptance(candidate_length=1.0,
                                                                                 baseline_length=1.0),
                                        candidate_accuracy=0.9, baseline_accuracy=0.9, n_questions=1319)],
                         candidate={"name": "cand"})
    flat = gate_from_baseline(r, registry()["gsm8k"], margin_points=2.0, mtp_margin_points=5.0, model_name=None)
    assert flat["min_acceptance_length"] == 1.0
    write_gate(path, flat)
    assert read_gate(path).min_acceptance_length == 1.0


@pytest.mark.slow  # the slow tier (make test-slow)
def test_gate_and_recovery_end_to_end_on_the_trained_toy(tmp_path):
    """A gate written from a baseline run, then applied: a threshold above what the candidate measured is a fail
    (exit 1) naming the gate, one below passes it; recovery with its interval is in report.json, report.md and the
    model card."""
    import json
    import shutil
    from pathlib import Path

    from evals.compare import EvalRequest, evaluate
    from evals.report.card import add_accuracy
    from quant.pipeline import quantize_checkpoint

    toy = Path(__file__).parent.parent / "evals" / "data" / "toy_arith" / "model"
    baseline = shutil.copytree(toy, tmp_path / "baseline")
    candidate = tmp_path / "cand"
    quantize_checkpoint(toy, candidate, check_engines=None, log=lambda m: None)
    common = dict(candidate=str(candidate), tasks="toy_arith", limit=20, max_gen_toks=24, dtype="float32", mtp=False)
    first = evaluate(EvalRequest(baseline=str(baseline), out=tmp_path / "e1", write_gate=tmp_path / "gate.yaml",
                                 **common), log=lambda m: None).to_json()
    written = yaml.safe_load((tmp_path / "gate.yaml").read_text())
    assert written["task"] == "toy_arith" and written["num_questions"] == 20 and written["num_fewshot"] == 5
    assert written["accuracy_threshold"] == round(first["rows"][0]["comparison"]["baseline_accuracy"], 4)

    measured = first["rows"][0]["comparison"]["candidate_accuracy"]
    rec = first["rows"][0]["recovery"]
    assert rec["ci_low"] <= rec["ratio"] <= rec["ci_high"]
    assert "recovery [95% CI]" in (tmp_path / "e1" / "report.md").read_text()
    assert json.loads((tmp_path / "e1" / "report.json").read_text())["rows"][0]["recovery"] == rec
    assert "recovery [95% CI]" in add_accuracy(candidate, first, tmp_path / "e1").read_text()

    # Above what it measured: a draft acceptance length no draft reaches (the trained toy may answer all 20).
    high = tmp_path / "high.yaml"
    high.write_text("task: toy_arith\naccuracy_threshold: 0.0\nmin_acceptance_length: 50\nnum_questions: 20\n")
    missed = evaluate(EvalRequest(baseline_run=tmp_path / "e1", out=tmp_path / "e2", gate=high,
                                  **{**common, "mtp": True}), log=lambda m: None).to_json()
    assert missed["verdict"] == "fail" and missed["exit_code"] == 1 and not missed["gate"]["passed"]
    assert "## CI gate" in (tmp_path / "e2" / "report.md").read_text()
    low = tmp_path / "low.yaml"
    low.write_text(f"task: toy_arith\naccuracy_threshold: {max(0.0, measured - 0.01):.4f}\ntolerance: 0.0\n")
    passed = evaluate(EvalRequest(baseline_run=tmp_path / "e1", out=tmp_path / "e3", gate=low, **common),
                      log=lambda m: None).to_json()
    assert passed["gate"]["passed"] and passed["verdict"] == first["verdict"]


def test_write_gate_never_writes_into_a_checkpoint_or_over_a_file(tmp_path):
    import shutil
    from pathlib import Path

    from evals.compare import EvalRequest, evaluate

    toy = Path(__file__).parent.parent / "evals" / "data" / "toy_arith" / "model"
    cand = shutil.copytree(toy, tmp_path / "cand")
    (tmp_path / "mine.yaml").write_text("mine")
    for target, phrase in ((cand / "gate.yaml", "inside the candidate checkpoint"),
                           (tmp_path / "mine.yaml", "exists; choose a new path or pass --overwrite")):
        with pytest.raises(QuantError, match=phrase) as e:
            evaluate(EvalRequest(candidate=str(cand), baseline=str(toy), tasks="toy_arith", limit=2,
                                 out=tmp_path / "out", write_gate=target), log=lambda m: None)
        assert e.value.exit_code == 2
    assert not (tmp_path / "out").exists() and (tmp_path / "mine.yaml").read_text() == "mine"
    assert sorted(p.name for p in cand.iterdir()) == sorted(p.name for p in toy.iterdir())
