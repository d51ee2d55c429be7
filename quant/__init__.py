"""MXFP4/FP8 quantization and accuracy validation for Mixture-of-Experts checkpoints."""

import os

# Set before torch loads OpenMP (torch is imported lazily, after this package). Inductor's compiled kernels
# and eager ATen ops each run OpenMP parallel regions; with the default active wait, threads of one spin
# through the other's work: on 2 cores an eager dequantize after a compiled quantize ran 40x slower (544 ms
# vs 12 ms for 128 rows of a GLM-5 expert). Compiling in-process avoids a pool of busy compile workers.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# numpy (imported to read safetensors headers) starts OpenBLAS's thread server, whose idle thread spins for a
# tenth of a second on a core the source hashing needs; nothing here multiplies matrices with numpy.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

__version__ = "0.1.0"
