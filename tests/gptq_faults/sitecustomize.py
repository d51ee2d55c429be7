"""The GPTQ tests' fault injection, in the real processes they start (`quant quantize --ranks N`, torchrun's ranks):
a test puts this directory on PYTHONPATH (`kill_env`) with QUANT_GPTQ_KILL="RANK:LAYER", and that rank kills
itself (SIGKILL, as `kill -9` would) as it starts decoder layer LAYER (0-based), through the layer loop's
`on_layer_start` hook (quant.gptq.loop). The quant package itself reads no such variable."""

import os
from pathlib import Path

KILL_ENV = "QUANT_GPTQ_KILL"


def kill_env(spec: str) -> dict:
    """The environment additions that make rank RANK die at layer LAYER (`spec` "RANK:LAYER") in a subprocess."""
    path = os.pathsep.join(p for p in (str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH")) if p)
    return {KILL_ENV: spec, "PYTHONPATH": path}


def _install(spec: str) -> None:
    import signal

    from quant.gptq import loop

    def die(ranks, layer: int) -> None:
        if spec == f"{ranks.rank}:{layer}":
            os.kill(os.getpid(), signal.SIGKILL)

    loop.on_layer_start.append(die)


if os.environ.get(KILL_ENV):
    _install(os.environ[KILL_ENV])
