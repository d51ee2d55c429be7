"""What a choice costs in stored bytes: the tensors the scheme writes (quant.planning.written: MXFP4's packing,
its E8M0 scales, FP8's per-channel scales, as written), plus an upper bound on each tensor's safetensors header
entry (a budget must never be overshot)."""

from __future__ import annotations

from quant.checkpoint import DTYPE_BYTES
from quant.planning.schemes import Scheme
from quant.planning.written import written_tensors

OFFSET_DIGITS = 15  # data_offsets digits counted per entry: room for a 999 TB shard


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
