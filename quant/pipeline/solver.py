"""A weight solver: what computes the quantized values of some weights instead of rounding them to nearest
(`quantize_checkpoint(..., method="gptq", gptq=SOLVER)`; GPTQ's is quant.gptq.GptqSettings).

The command hands the solver to the pipeline; the pipeline knows it only through `WeightSolver` (and never imports
a solver: lint-imports). Before OUT is touched the pipeline asks it to `check` the checkpoint and records its
settings (`to_dict`) in the plan, so that other settings give another plan digest; after planning, it hands it a
`SolveRequest` and gets back a `Solution`, from which each shard takes the solved weights (`parts`); every weight
the solution has no parts for is rounded to nearest, as without a solver.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    from quant.checkpoint import Checkpoint
    from quant.planning.plan import Plan, TensorJob


@dataclass(frozen=True)
class SolveRequest:
    """What the pipeline gives a solver."""

    plan: Plan  # every job: the solver solves some of the `quantize` ones (plan.scale_mode: the scale rule)
    ckpt: Checkpoint
    src_path: Path
    store: Path  # the solver's directory in OUT: what it saves there, a resumed run finds again (removed at publish)
    devices: list[str]  # the run's devices (the first one computes everything but the solves themselves)
    layer_returns: list[str]  # family data: what the family's decoder layer returns (hidden states first)
    digest: str  # the plan's digest: what the solver saved under another digest is not reused
    log: Callable[[str], None]
    write: Callable[..., None]  # write(path, data, tmp_dir): the pipeline's atomic file write, for `store`


class Solution(Protocol):
    """What a solver returns: the solved weights, read while the shards are written."""

    timing: dict[str, float]  # seconds per phase of the solve (added to the returned manifest's timing)

    def parts(self, job: TensorJob) -> tuple[dict | None, dict]:
        """({suffix: tensor} of a weight's solved output tensors, or None to round it to nearest; the record added
        to the weight's manifest entry)."""


class WeightSolver(Protocol):
    method: str  # the --method it implements ("gptq"): the output's identity, and its timing's name

    def to_dict(self) -> dict:
        """The settings, recorded in the plan's settings (and so in its digest and the manifest)."""

    def check(self, src_path: Path, ckpt: Checkpoint) -> None:
        """Refuse (QuantError) a source or setting the solver cannot run, before OUT is touched."""

    def solve(self, request: SolveRequest) -> Solution:
        """Solve the weights (the caller has loaded torch and set the thread count for `request.devices[0]`)."""
