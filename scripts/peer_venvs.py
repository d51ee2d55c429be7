"""The peers' venvs the benchmark scripts build on first use (scripts/bench_gptq_peers.py,
scripts/bench_search_peers.py): torch pinned to the local CPU build first (an unpinned torch pulls GBs of CUDA
wheels), the peer with that pin as a constraint, then this venv's transformers, which the toys' configs need."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TORCH_PIN = "torch==2.13.0"


def build_peer_venv(venv: Path, packages: list[str], label: str) -> Path | None:
    """The python of `venv`, built with `packages` unless its stamp says it already is; None, with one line, if it
    cannot be built."""
    import transformers

    python = venv / "bin" / "python"
    stamp = venv / f".installed-{'-'.join(packages)}-transformers-{transformers.__version__}"
    if stamp.is_file():
        return python
    print(f"building {venv.name} ({' '.join(packages)}; a few minutes) ...", flush=True)
    log = venv / "install.log"
    try:
        if not python.is_file():
            proc = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise OSError((proc.stderr or proc.stdout).strip().splitlines()[-1])
        (venv / "constraints.txt").write_text(TORCH_PIN + "\n")
        pip = [str(python), "-m", "pip", "install", "-q", "-c", str(venv / "constraints.txt")]
        with log.open("w") as f:
            subprocess.run(pip + [TORCH_PIN, *packages], check=True, stdout=f, stderr=subprocess.STDOUT)
            subprocess.run(pip + [f"transformers=={transformers.__version__}"], check=True, stdout=f,
                           stderr=subprocess.STDOUT)
    except (subprocess.CalledProcessError, OSError) as e:
        tail = [line for line in log.read_text().splitlines() if "ERROR" in line][-1:] or [str(e)] \
            if log.is_file() else [str(e)]
        print(f"{label}: skipped, its venv {venv.name} could not be built ({tail[0][:200]}; see {log})")
        return None
    stamp.touch()
    return python
