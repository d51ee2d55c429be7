"""How the tiers run a probe: through a zygote (zygote.py: the engine imported once, one forked child per
checkpoint) or, with QUANT_ENGINE_FORK=0, as a fresh interpreter per checkpoint, the way the zygote's children
must behave (the tier passes either way; the fresh path is there to check that claim and to bisect a surprise).

A zygote serves one (interpreter, probe, environment): a case whose environment differs (vLLM's forced emulation,
another SGLang release on PYTHONPATH) gets a zygote of its own, so a child's environment is always the one the
subprocess would have had.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

ZYGOTE = Path(__file__).with_name("zygote.py")
FORK = os.environ.get("QUANT_ENGINE_FORK", "1") != "0"


@dataclass
class Completed:
    """What subprocess.run would have returned: the exit status (-N: ended by signal N) and the output."""
    returncode: int
    stdout: str
    stderr: str


class Zygote:
    def __init__(self, python: str, probe: str, env: dict):
        self.log = tempfile.NamedTemporaryFile(prefix="zygote-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([python, str(ZYGOTE), probe], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env=env, text=True)
        ready = json.loads(self.proc.stdout.readline() or '{"ready": false, "error": "zygote exited"}')
        if not ready.get("ready"):
            log = self._log_tail()
            self.close()
            raise RuntimeError(f"{probe} could not be set up in {python}: {ready.get('error')}\n"
                               f"{ready.get('trace', '')}{log}")

    def _log_tail(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def run(self, argv: list[str], env: dict, timeout: float) -> Completed:
        self.proc.stdin.write(json.dumps({"argv": argv, "env": env, "timeout": timeout}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the zygote exited ({self.proc.poll()}): {self._log_tail()}")
        reply = json.loads(line)
        return Completed(reply["rc"], reply["stdout"], reply["stderr"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        os.unlink(self.log.name)


_ZYGOTES: dict[tuple, Zygote] = {}


def run_probe(python: str, probe: Path, argv: list[str], env: dict, timeout: float) -> Completed:
    """Run `python probe argv...` in `env`: a forked child of the zygote for (python, probe, env), or a fresh
    process when QUANT_ENGINE_FORK=0. A timeout kills the child (returncode -9)."""
    env = {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}  # pytest's per-test marker, not a setting
    if not FORK:
        try:
            proc = subprocess.run([python, str(probe), *argv], capture_output=True, text=True, timeout=timeout,
                                  env=env)
        except subprocess.TimeoutExpired as e:
            return Completed(-9, e.stdout or "", e.stderr or "")
        return Completed(proc.returncode, proc.stdout, proc.stderr)
    key = (python, str(probe), json.dumps(env, sort_keys=True))
    if key not in _ZYGOTES:
        _ZYGOTES[key] = Zygote(python, str(probe), env)
    try:
        return _ZYGOTES[key].run(argv, {}, timeout)
    except RuntimeError:
        _ZYGOTES.pop(key).close()
        raise


@atexit.register
def _close_all() -> None:
    for zygote in _ZYGOTES.values():
        zygote.close()
    _ZYGOTES.clear()
