"""The zygote the tiers run their probes through (zygote.py, probe_runner.py) must behave as a fresh process per
checkpoint would: the child's output and exit status come back as they were, a crash or a timeout ends only that
child, and nothing a child changes is seen by the next one."""

from __future__ import annotations

import os
import sys

import pytest

from tests_engines import probe_runner

PROBE = '''
import json, os, signal, sys, time
STATE = {"preloaded": False, "runs": 0}

def preload():
    STATE["preloaded"] = True

def main():
    action = sys.argv[1]
    STATE["runs"] += 1  # a child's change: the next child must not see it
    print(json.dumps({"preloaded": STATE["preloaded"], "runs": STATE["runs"], "pid": os.getpid(),
                      "flag": os.environ.get("PROBE_FLAG")}))
    print("to stderr", file=sys.stderr)
    if action == "exit3":
        return 3
    if action == "raise":
        raise ValueError("boom")
    if action == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if action == "sleep":
        time.sleep(60)
    return 0
'''


@pytest.fixture()
def probe(tmp_path, monkeypatch):
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    monkeypatch.setattr(probe_runner, "FORK", True)
    monkeypatch.setattr(probe_runner, "RESULTS", None)  # every call a child (make test-engines sets a results dir)
    yield path
    probe_runner._close_all()


def _run(probe, action, env=None, timeout=30):
    return probe_runner.run_probe(sys.executable, probe, [action], env or dict(os.environ), timeout)


def test_children_are_separate_processes_forked_after_the_preload(probe):
    import json

    first, second = (json.loads(_run(probe, "ok").stdout.splitlines()[0]) for _ in range(2))
    assert first["preloaded"] and second["preloaded"]
    assert first["runs"] == second["runs"] == 1  # the first child's change did not reach the second
    assert first["pid"] != second["pid"] != os.getpid()


def test_exit_status_output_and_crashes_come_back_and_the_zygote_survives(probe):
    assert _run(probe, "exit3").returncode == 3
    raised = _run(probe, "raise")
    assert raised.returncode == 1 and "ValueError: boom" in raised.stderr and "to stderr" in raised.stderr
    assert _run(probe, "segv").returncode == -11
    assert _run(probe, "sleep", timeout=1).returncode == -9
    assert _run(probe, "ok").returncode == 0 and len(probe_runner._ZYGOTES) == 1


def test_another_environment_gets_another_zygote(probe):
    import json

    flagged = _run(probe, "ok", {**os.environ, "PROBE_FLAG": "x"})
    assert json.loads(flagged.stdout.splitlines()[0])["flag"] == "x"
    assert json.loads(_run(probe, "ok").stdout.splitlines()[0])["flag"] is None
    assert len(probe_runner._ZYGOTES) == 2


def test_a_preload_that_fails_is_an_error_not_an_outcome(tmp_path, monkeypatch):
    path = tmp_path / "broken.py"
    path.write_text("def preload():\n    import vllm_emulation_missing\n\ndef main():\n    return 0\n")
    monkeypatch.setattr(probe_runner, "FORK", True)
    with pytest.raises(RuntimeError, match="vllm_emulation_missing"):
        probe_runner.run_probe(sys.executable, path, [], dict(os.environ), 30)


def test_kept_outcomes_answer_only_identical_inputs(probe, tmp_path, monkeypatch):
    """QUANT_ENGINE_RESULTS: a probe already completed on the same checkpoint bytes and settings is answered from its
    kept outcome (the same child output, no new child); a changed byte, another setting or a failed probe runs."""
    import json

    monkeypatch.setattr(probe_runner, "RESULTS", str(tmp_path / "results"))
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    (checkpoint / "quant_manifest.json").write_text('{"source": "/somewhere"}')

    def pid(action="ok", env=None):
        done = probe_runner.run_probe(sys.executable, probe, [action, str(checkpoint)], env or dict(os.environ), 30)
        return done.returncode, json.loads(done.stdout.splitlines()[0])["pid"]

    first = pid()
    assert pid() == first  # answered from the kept outcome
    (checkpoint / "quant_manifest.json").write_text('{"source": "/elsewhere"}')  # no engine reads it
    assert pid() == first
    (checkpoint / "model.safetensors").write_bytes(b"weightz")
    changed = pid()
    assert changed != first and pid() == changed
    assert pid(env={**os.environ, "QUANT_VLLM_EMULATION": "force"}) != changed
    failed = pid("exit3")
    assert failed[0] == 3 and pid("exit3") != failed  # a failed probe is never kept
