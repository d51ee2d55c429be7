"""What a choice costs in stored bytes: the tensors the scheme writes, read off a probe quantized by the scheme
itself (so MXFP4's packing, its E8M0 scales, FP8's per-channel scales are counted as written), plus an upper
bound on each tensor's safetensors header entry (a budget must never be overshot)."""

from __future__ import annotations

from functools import lru_cache

from quant.checkpoint import DTYPE_BYTES
from quant.planning.schemes import Scheme

PROBE_ROWS = (128, 256)  # row counts every row-wise scheme takes whole; two of them give bytes = a + b * rows
OFFSET_DIGITS = 15  # data_offsets digits counted per entry: room for a 999 TB shard
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


def header_bytes(name: str, dtype: str, shape: tuple[int, ...]) -> int:
    """An upper bound on `"name":{"dtype":..,"shape":[..],"data_offsets":[a,b]},` in a safetensors header."""
    return len(name) + len(dtype) + len(",".join(str(d) for d in shape)) + 2 * OFFSET_DIGITS + 48


def stored_bytes(module: str, shape: tuple[int, int], source_dtype: str,
                 scheme: Scheme | None) -> tuple[int, int]:
    """(data bytes, data + header bytes) of `module` written with `scheme` (None: kept as stored)."""
    rows, cols = shape
    if scheme is None:
        data = rows * cols * DTYPE_BYTES[source_dtype]
        return data, data + header_bytes(module + ".weight", source_dtype, shape)
    data = total = 0
    for suffix, dtype, fixed, per_row, trailing in written_tensors(scheme, cols):
        nbytes = fixed + per_row * rows
        data += nbytes
        total += nbytes + header_bytes(f"{module}.{suffix}", dtype, (rows, *trailing))
    return data, total
