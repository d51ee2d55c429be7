"""Test-only hooks of the GPTQ run, installed in the real processes the tests and benchmarks start (`quant quantize
--ranks N`, torchrun's ranks): a caller puts this directory on PYTHONPATH with one of these variables set, and
Python imports this file as each process starts. The quant package itself reads no such variable: it only runs
the hooks its lists hold (empty in production).

- QUANT_GPTQ_KILL="RANK:LAYER" (`kill_env`, tests/test_gptq_ranks.py): that rank kills itself (SIGKILL, as `kill -9`
  would) as it starts decoder layer LAYER (0-based), through the layer loop's `on_layer_start` hook
  (quant.gptq.loop).
- QUANT_GPTQ_TIMING=PREFIX (`timing_env`, scripts/bench_gptq_ranks.py): as the run ends, each rank (one process:
  rank 0) writes PREFIX.RANK, its `quant.gptq.progress.timing_record` as JSON (its seconds per phase, the CPU
  seconds of the phases that count them, the bytes its collectives moved), through the `on_run_end` hook
  (quant.gptq.progress)."""

import os
from pathlib import Path

KILL_ENV = "QUANT_GPTQ_KILL"
TIMING_ENV = "QUANT_GPTQ_TIMING"


def _pythonpath() -> str:
    """PYTHONPATH with this directory first (its sitecustomize is the one Python imports)."""
    return os.pathsep.join(p for p in (str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH")) if p)


def kill_env(spec: str) -> dict:
    """The environment additions that make rank RANK die at layer LAYER (`spec` "RANK:LAYER") in a subprocess."""
    return {KILL_ENV: spec, "PYTHONPATH": _pythonpath()}


def timing_env(prefix: str | os.PathLike) -> dict:
    """The environment additions that make every rank of a subprocess's GPTQ run write PREFIX.RANK."""
    return {TIMING_ENV: str(prefix), "PYTHONPATH": _pythonpath()}


def _install_kill(spec: str) -> None:
    import signal

    from quant.gptq import loop

    def die(ranks, layer: int) -> None:
        if spec == f"{ranks.rank}:{layer}":
            os.kill(os.getpid(), signal.SIGKILL)

    loop.on_layer_start.append(die)


def _install_timing(prefix: str) -> None:
    import json

    from quant.gptq import progress

    def write(record: dict) -> None:
        Path(f"{prefix}.{record['rank']}").write_text(json.dumps(record, sort_keys=True))

    progress.on_run_end.append(write)


if os.environ.get(KILL_ENV):
    _install_kill(os.environ[KILL_ENV])
if os.environ.get(TIMING_ENV):
    _install_timing(os.environ[TIMING_ENV])
