"""MXFP4/FP8 quantization and accuracy validation for Mixture-of-Experts checkpoints."""

__version__ = "0.1.0"
