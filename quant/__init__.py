"""MXFP4/FP8 quantization and accuracy validation for Mixture-of-Experts checkpoints."""

from quant.process import thread_env

thread_env()  # before torch loads OpenMP (torch is imported lazily, after this package): see quant/process.py

__version__ = "0.1.0"
