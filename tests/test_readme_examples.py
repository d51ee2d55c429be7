"""The README's local `quant` examples run as written (issue #42): the Quantize block and the verify-manifest block,
each command as the README spells it, with /tmp/ and CKPT pointed at a scratch directory, exiting as the README
says (0, or 1 where its comment says the check fails). Hub examples (org/model) need the network and are left to
tests/test_hub_preflight.py's local hub server."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
QUANT = [sys.executable, "-m", "quant"]

pytestmark = pytest.mark.slow


def readme_commands(first: str) -> list[tuple[str, str]]:
    """(command, comment) of each line of the README's bash block whose first command starts with `first`,
    continuation comments joined to their command's."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    block = next(b for b in blocks if b.lstrip().startswith(first))
    out: list[tuple[str, str]] = []
    for line in block.splitlines():
        code, _, comment = line.partition("#")
        if code.strip():
            out.append((code.strip(), comment.strip()))
        elif out and comment:
            out[-1] = (out[-1][0], f"{out[-1][1]} {comment.strip()}")
    return out


def expected_exit(comment: str) -> int:
    return 1 if re.search(r"\bfails\b", comment) else 0


def run(command: str, tmp: Path) -> subprocess.CompletedProcess:
    command = command.replace("/tmp/", f"{tmp}/").replace("CKPT", f"{tmp}/glm5-mxfp4")
    argv = shlex.split(command)
    assert argv[0] == "quant", command
    return subprocess.run(QUANT + argv[1:] + (["--no-progress"] if argv[1] == "quantize" else []),
                          capture_output=True, text=True, cwd=tmp)


def test_the_quantize_and_verify_examples_run_as_written(tmp_path):
    commands = readme_commands("quant toy glm5") + [
        c for c in readme_commands("quant verify-manifest /tmp/") if not re.search(r"\borg/", c[0])]
    assert len(commands) >= 8, commands
    for command, comment in commands:
        proc = run(command, tmp_path)
        assert proc.returncode == expected_exit(comment), (command, proc.returncode, proc.stderr[-2000:])
    assert (tmp_path / "glm5-fp8" / "model.safetensors").exists() or list((tmp_path / "glm5-fp8").glob("*.safetensors"))
