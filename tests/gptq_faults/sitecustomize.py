"""Test-only wrappers of the GPTQ run, installed in the real processes the tests and benchmarks start (`quant quantize
--ranks N`, torchrun's ranks): a caller puts this directory on PYTHONPATH with one of these variables set, and
Python imports this file as each process starts. The quant package itself reads no such variable and holds no
hook: these wrap its public functions (the layer loop's `LayerLoop.run`, the run's `report_run`).

- QUANT_GPTQ_KILL="RANK:LAYER" (`kill_env`, tests/test_gptq_ranks.py): that rank kills itself (SIGKILL, as `kill -9`
  would) as it starts decoder layer LAYER (0-based), before the layer loop's `LayerLoop.run` (quant.gptq.loop).
- QUANT_GPTQ_TIMING=PREFIX (`timing_env`, scripts/bench_gptq_ranks.py): as the run ends, each rank (one process:
  rank 0) writes PREFIX.RANK, its `quant.gptq.progress.timing_record` as JSON (its seconds per phase, the CPU
  seconds of the phases that count them, the bytes its collectives moved), after the run's closing line
  (`report_run`, as quant.gptq.run calls it)."""

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

    run = loop.LayerLoop.run

    def dying_run(self, index: int, *args, **kwargs):
        if spec == f"{self.ranks.rank}:{index}":
            os.kill(os.getpid(), signal.SIGKILL)
        return run(self, index, *args, **kwargs)

    loop.LayerLoop.run = dying_run


def _install_timing(prefix: str) -> None:
    import json

    from quant.gptq import progress, run

    report_run = run.report_run

    def reporting_run(log, ranks, timing, *args) -> None:
        report_run(log, ranks, timing, *args)
        record = progress.timing_record(ranks, timing, args[-1])  # comm_cpu, report_run's last argument
        Path(f"{prefix}.{record['rank']}").write_text(json.dumps(record, sort_keys=True))

    run.report_run = reporting_run


if os.environ.get(KILL_ENV):
    _install_kill(os.environ[KILL_ENV])
if os.environ.get(TIMING_ENV):
    _install_timing(os.environ[TIMING_ENV])
