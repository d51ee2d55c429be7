"""The safetensors header, read as the safetensors library reads it: one parser for a header in hand
(`parse_header`: bytes fetched over HTTP, quant.hub) and one for a file on disk (`read_header`), both refusing, in the
library's words, what it refuses to open, and both bounded (a length prefix over MAX_HEADER or past the file's end is
refused before anything is allocated)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

MAX_HEADER = 100_000_000  # the safetensors library's limit

# safetensors dtypes and their widths in bits (the safetensors library's Dtype).
DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
              "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
              "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}


def _bad(why: str) -> ValueError:
    return ValueError(f"Error while deserializing header: {why}")


def parse_header(data: bytes, total: int) -> tuple[dict, int, dict]:
    """(name -> (dtype, shape) in name order, start of the data region, name -> (begin, end) within it) of a
    safetensors file of `total` bytes that begins with `data` (at least its 8-byte length and header). Raises
    ValueError, in the safetensors library's words, for what it refuses to open."""
    if total < 8 or len(data) < 8:
        raise _bad("header too small")
    n = struct.unpack("<Q", data[:8])[0]
    if n > MAX_HEADER:
        raise _bad("header too large")
    if 8 + n > total:
        raise _bad("invalid header length")
    try:
        obj = json.loads(data[8:8 + n].decode("utf-8"))
    except UnicodeDecodeError as e:
        raise _bad(f"invalid UTF-8 in header: {e}") from None
    except json.JSONDecodeError as e:
        raise _bad(f"invalid JSON in header: {e}") from None
    if not isinstance(obj, dict):
        raise _bad("invalid JSON in header: expected an object of tensors")
    meta = obj.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise _bad("invalid JSON in header: __metadata__ must map strings to strings")
    entries = []
    for name, info in obj.items():
        ok = isinstance(info, dict) and info.get("dtype") in DTYPE_BITS
        shape, offsets = (info.get("shape"), info.get("data_offsets")) if ok else (None, None)
        ok = ok and isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
        ok = ok and isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0
                                                                            for o in offsets)
        if not ok:
            raise _bad(f"invalid JSON in header: tensor {name!r} needs a known dtype, a shape of sizes and two "
                       f"data_offsets")
        entries.append((tuple(offsets), name, info["dtype"], tuple(shape)))
    end = 0
    for (begin, stop), name, dtype, shape in sorted(entries):
        if begin != end or stop < begin:
            raise _bad(f"invalid offset for tensor `{name}`")
        bits = DTYPE_BITS[dtype]
        for d in shape:
            bits *= d
        if bits % 8:
            raise _bad("The slice is slicing for subbytes dtypes, and the slice does not end up at a byte "
                       "boundary, this is invalid.")
        if stop - begin != bits // 8:
            raise _bad("invalid shape, data type, or offset for tensor")
        end = stop
    if 8 + n + end != total:
        raise _bad("incomplete metadata, file not fully covered")
    entries.sort(key=lambda e: e[1])
    return ({name: (dtype, shape) for _, name, dtype, shape in entries}, 8 + n,
            {name: offsets for offsets, name, _, _ in entries})


def read_header(path: str | Path) -> tuple[dict, int, dict]:
    """`parse_header` of the safetensors file at `path`, reading only its length prefix and header. Raises
    ValueError as parse_header does, OSError when the file cannot be read."""
    with open(path, "rb") as f:
        total = f.seek(0, 2)
        f.seek(0)
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        if len(head) < 8 or n > MAX_HEADER or 8 + n > total:
            return parse_header(head, total)  # refused in the library's words, nothing more read
        data = head + f.read(n)
    return parse_header(data, total)
