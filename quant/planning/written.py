"""The tensors a scheme writes for one linear: read off a probe quantized by the scheme itself, so MXFP4's
packing, its E8M0 scales and FP8's per-channel scales are what the exporter writes (the search prices them, the
export preview lists them)."""

from __future__ import annotations

from functools import lru_cache

from quant.planning.schemes import Scheme

PROBE_ROWS = (128, 256)  # row counts every row-wise scheme takes whole; two of them give bytes = a + b * rows
DTYPE_NAMES = {"torch.uint8": "U8", "torch.float8_e4m3fn": "F8_E4M3", "torch.float32": "F32",
               "torch.bfloat16": "BF16", "torch.int8": "I8"}


@lru_cache(maxsize=None)
def written_tensors(scheme: Scheme, in_features: int) -> tuple[tuple[str, str, int, int, tuple[int, ...]], ...]:
    """(suffix, dtype, bytes at rows 0, bytes per row, trailing shape) of each tensor `scheme` writes."""
    import torch

    probes = [scheme.quantize(torch.ones(rows, in_features), "even") for rows in PROBE_ROWS]
    out = []
    for suffix, small in probes[0].items():
        large = probes[1][suffix]
        a_bytes = small.numel() * small.element_size()
        per_row = (large.numel() * large.element_size() - a_bytes) // (PROBE_ROWS[1] - PROBE_ROWS[0])
        out.append((suffix, DTYPE_NAMES[str(small.dtype)], a_bytes - per_row * PROBE_ROWS[0], per_row,
                    tuple(small.shape[1:])))
    return tuple(out)
