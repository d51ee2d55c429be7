"""Quantization numerics: MXFP4 (`mxfp4`) and FP8 E4M3 (`fp8`) as pure tensor functions."""

SCALE_MODES = ("even", "floor", "rceil", "search")  # MXFP4 shared-exponent rules; see mxfp4.py
