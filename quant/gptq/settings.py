"""GPTQ's settings (`GptqSettings`), and the solver the quantize command hands the pipeline: a
`quant.pipeline.solver.WeightSolver` (`check`, `to_dict`, `solve`) whose `solve` is `run.solve_checkpoint`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from quant.errors import QuantError
from quant.gptq.calibration import CalibrationSettings, data_identity
from quant.gptq.layer import MIN_EXPERT_TOKENS
from quant.gptq.run import solve_checkpoint
from quant.model_exec.layers import meta_model


@dataclass(frozen=True)
class GptqSettings:
    """GPTQ's settings, and the solver the quantize command hands the pipeline (a
    `quant.pipeline.solver.WeightSolver`: `check`, `to_dict`, `solve`)."""

    method: ClassVar[str] = "gptq"
    calibration: CalibrationSettings = field(default_factory=CalibrationSettings)
    damp: float = 0.01  # relative to the mean diagonal of H, as in GPTQ's reference code
    batch: int = 8  # calibration windows per forward call
    hessian_bytes: int = 4 << 30  # budget for one pass's expert Hessians; more experts take more passes
    solve_bytes: int = 1 << 29  # budget for the solver's working set; more experts are solved in more groups
    # This process's place among torch.distributed ranks (`quant.gptq.ranks.Ranks`), None for one process: never
    # part of the settings' identity (the same export on any number of ranks).
    ranks: object = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        """--damp must be a positive finite number: 0 leaves a singular Hessian singular, a negative one makes it
        indefinite, NaN poisons every solve (each used to stop deep inside the first layer)."""
        damp = self.damp
        if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not math.isfinite(damp) or damp <= 0:
            shown = f"{damp:g}" if isinstance(damp, (int, float)) else repr(damp)
            raise QuantError(f"--damp {shown}: must be a positive finite number (default 0.01)")
        if self.batch < 1:
            raise QuantError(f"GPTQ batch {self.batch}: must be at least 1")

    def to_dict(self, with_identity: bool = True) -> dict:
        d = {"method": "gptq", "damp": self.damp, "min_expert_tokens": MIN_EXPERT_TOKENS,
             "calibration": self.calibration.to_dict()}
        if with_identity:
            d["calibration"]["identity"] = data_identity(self.calibration.data)
        return d

    def check(self, src_path: Path, ckpt) -> None:
        """The calibration data, and the family: one transformers cannot build GPTQ's decoder layers of is refused
        (QuantError) before any work."""

        self.calibration.check()
        meta_model(src_path, ckpt)
        if self.ranks is not None and self.ranks.size > 1:
            from quant.gptq.ranks import lead_prepare

            lead_prepare(self.ranks, src_path)

    def solve(self, request):
        """`run.solve_checkpoint` for the pipeline's `quant.pipeline.solver.SolveRequest` (rank 0 of several: the
        other ranks are handed the run first, `ranks.lead_solve`); returns its `persist.SolvedWeights`."""

        ranks, devices = self.ranks, request.devices
        if ranks is not None and ranks.size > 1:
            from quant.gptq.ranks import lead_solve

            lead_solve(ranks, request, self)
            devices = [ranks.device]
        return solve_checkpoint(request.plan, request.ckpt, request.src_path, request.store, devices, self,
                                request.layer_returns, request.digest, request.write, request.log, ranks=ranks)
