"""GPTQ for MXFP4 (`quant quantize --method gptq`): calibration data through the decoder layers one at a time,
error-aware rounding of each MXFP4 weight, the same Quark-schema output as round-to-nearest."""

from quant.gptq.calibration import DEFAULT_DATA, CalibrationSettings
from quant.gptq.run import GptqSettings, solve_checkpoint
from quant.gptq.solve import gptq_mxfp4, output_error

__all__ = ["DEFAULT_DATA", "CalibrationSettings", "GptqSettings", "gptq_mxfp4", "output_error", "solve_checkpoint"]
