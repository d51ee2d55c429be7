"""Quantization numerics: MXFP4 (`mxfp4`) and FP8 E4M3 (`fp8`) as pure tensor functions."""
