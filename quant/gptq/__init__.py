"""GPTQ for MXFP4 (`quant quantize --method gptq`): calibration data through the decoder layers one at a time,
error-aware rounding of each MXFP4 weight, the same Quark-schema output as round-to-nearest.

Names are handed on lazily: the CLI reads `DEFAULT_DATA` for its help text, which must not load torch."""

from importlib import import_module

_WHERE = {"DEFAULT_DATA": "calibration", "CalibrationSettings": "calibration", "GptqSettings": "settings",
          "solve_checkpoint": "run", "gptq_mxfp4": "solve", "output_error": "solve"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
