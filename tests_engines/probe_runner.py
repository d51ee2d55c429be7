"""How the tiers run a probe: through a zygote (zygote.py: the engine imported once, one forked child per
checkpoint) or, with QUANT_ENGINE_FORK=0, as a fresh interpreter per checkpoint, the way the zygote's children
must behave (the tier passes either way; the fresh path is there to check that claim and to bisect a surprise).

A zygote serves one (interpreter, probe, environment): a case whose environment differs (vLLM's forced emulation,
another SGLang release on PYTHONPATH) gets a zygote of its own, so a child's environment is always the one the
subprocess would have had.

With QUANT_ENGINE_RESULTS set to a directory (`make test-engines` gives each run a fresh one), every completed probe
is kept there under the digest of what determines it: the interpreter, the probe and the tier's own code, the
engine settings in the environment, and the bytes of every checkpoint directory it was given. The matrix step of
the same run (scripts/engine_matrix.py) rebuilds the same seeded exports, byte for byte, so it reads the outcomes the
tiers observed instead of running every probe a second time; anything that differs is run.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

ZYGOTE = Path(__file__).with_name("zygote.py")
FORK = os.environ.get("QUANT_ENGINE_FORK", "1") != "0"
RESULTS = os.environ.get("QUANT_ENGINE_RESULTS")
SETTINGS = ("QUANT_", "VLLM_", "SGLANG_", "TOKENIZERS_", "PYTHONPATH")  # environment keys that change an outcome
# Files of a checkpoint no engine reads and that name where it was written (the manifest's source path, the card):
# left out of its digest, so the same export built in another directory is the same input.
UNREAD = ("quant_manifest.json", "README.md")


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


def _tree_digest(path: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file() and p.name not in UNREAD
                       and not any(part.startswith(".") for part in p.relative_to(path).parts)):
        digest.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _is_dir(arg: str) -> bool:
    try:
        return Path(arg).is_dir()
    except OSError:  # an argument that is data, not a path (the prompts' JSON)
        return False


@functools.cache
def _code_digest() -> str:
    """The tier's own code (this directory's modules), once per process: a changed line is another input."""
    return ",".join(f"{p.name}:{hashlib.sha256(p.read_bytes()).hexdigest()}"
                    for p in sorted(Path(__file__).parent.glob("*.py")))


def _result_file(python: str, probe: Path, argv: list[str], env: dict) -> Path:
    digest = hashlib.sha256()
    parts = [python, str(probe), _code_digest()]
    parts += [f"dir:{_tree_digest(Path(a))}" if _is_dir(a) else a for a in argv]
    parts += [f"{k}={v}" for k, v in sorted(env.items()) if k.startswith(SETTINGS)]
    for part in parts:
        digest.update(part.encode() + b"\0")
    return Path(RESULTS) / f"{digest.hexdigest()}.json"


def run_probe(python: str, probe: Path, argv: list[str], env: dict, timeout: float) -> Completed:
    """Run `python probe argv...` in `env`: a forked child of the zygote for (python, probe, env), or a fresh
    process when QUANT_ENGINE_FORK=0. A timeout kills the child (returncode -9). With QUANT_ENGINE_RESULTS, a probe
    already completed on the same inputs in this run is answered from its kept outcome."""
    env = {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}  # pytest's per-test marker, not a setting
    if not RESULTS:
        return _run(python, probe, argv, env, timeout)
    kept = _result_file(python, probe, argv, env)
    if kept.exists():
        return Completed(**json.loads(kept.read_text()))
    done = _run(python, probe, argv, env, timeout)
    if done.returncode == 0:
        kept.parent.mkdir(parents=True, exist_ok=True)
        partial = kept.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(done.__dict__))
        partial.replace(kept)
    return done


def _run(python: str, probe: Path, argv: list[str], env: dict, timeout: float) -> Completed:
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
