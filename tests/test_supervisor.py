"""A native crash reaches the user as one line and exit 70, never as glibc's abort (issue #48): `quant` runs each
command in a child process (quant.process.supervise) and reads how it died. The child is made to die by a real
signal as it starts (a sitecustomize on PYTHONPATH: os.abort() is C's abort(), the death glibc gives a corrupted
heap); every other death and signal is passed on as it is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

SITE = """
import os, signal
how = os.environ.get("QUANT_TEST_DEATH")
if how and os.environ.get("QUANT_SUPERVISED"):  # the child only
    os.abort() if how == "abort" else os.kill(os.getpid(), getattr(signal, how))
"""


def _run(tmp_path, death: str | None, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "site").mkdir(exist_ok=True)
    (tmp_path / "site" / "sitecustomize.py").write_text(SITE)
    env = {k: v for k, v in os.environ.items() if k not in ("QUANT_NO_SUPERVISOR", "QUANT_SUPERVISED")}
    env.update(PYTHONPATH=str(tmp_path / "site"), **({"QUANT_TEST_DEATH": death} if death else {}))
    return subprocess.run([sys.executable, "-m", "quant", *args], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.mark.parametrize("death", ["abort", "SIGSEGV", "SIGBUS"])
def test_a_native_crash_is_one_line_and_exit_70(death, tmp_path):
    result = _run(tmp_path, death, "--help")
    assert result.returncode == 70, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    name = "SIGABRT" if death == "abort" else death
    assert len(lines) == 1 and lines[0].startswith("error: internal error (the process died of " + name), lines
    assert "double free" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("death", ["SIGTERM", "SIGKILL"])
def test_other_deaths_are_passed_on_as_they_are(death, tmp_path):
    """What a launcher sees (torchrun names a rank killed by a signal) is the child's own death."""
    result = _run(tmp_path, death, "--help")
    assert result.returncode == -getattr(signal, death), (result.returncode, result.stderr)


def test_a_run_without_a_crash_is_untouched(tmp_path):
    result = _run(tmp_path, None, "kernels", "status")
    assert result.returncode == 0, result.stderr
    unsupervised = subprocess.run([sys.executable, "-m", "quant", "kernels", "status"], capture_output=True,
                                  text=True, env={**os.environ, "QUANT_NO_SUPERVISOR": "1"}, timeout=120)
    assert result.stdout == unsupervised.stdout


def test_a_signal_sent_to_the_command_reaches_its_process(tmp_path):
    """SIGTERM to `quant` (what torchrun and job schedulers send) reaches the child, and nothing is left running."""
    proc = subprocess.Popen([sys.executable, "-m", "quant", "verify-manifest", "--help"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items() if k != "QUANT_NO_SUPERVISOR"})
    proc.communicate(timeout=120)  # warm: the same command, run to its end
    sleeper = tmp_path / "site"
    sleeper.mkdir()
    (sleeper / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('QUANT_SUPERVISED'):\n"
        "    open(os.environ['QUANT_TEST_PIDFILE'], 'w').write(str(os.getpid())); time.sleep(60)\n")
    pidfile = tmp_path / "child.pid"
    proc = subprocess.Popen([sys.executable, "-m", "quant", "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(sleeper), "QUANT_TEST_PIDFILE": str(pidfile)})
    for _ in range(600):
        if pidfile.exists() and pidfile.read_text():
            break
        time.sleep(0.05)
    child = int(pidfile.read_text())
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)
