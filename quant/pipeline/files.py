"""File primitives of the pipeline: content hashes and atomic writes. Torch-free, so the quantize command can
start hashing the source while torch is still loading."""

from __future__ import annotations

import hashlib
import mmap
import os
from pathlib import Path


def sha256_file(path: Path, window: int = 1 << 26) -> str:
    """sha256 of a file, read through memory maps of 64 MB windows: hashing straight from the page cache
    saves copying every byte into a buffer first, and unmapping each window keeps the process's resident
    memory flat. hashlib releases the GIL while it hashes, so this runs beside quantizing."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        for start in range(0, size, window):
            with mmap.mmap(f.fileno(), min(window, size - start), offset=start, access=mmap.ACCESS_READ) as m:
                h.update(m)
    return h.hexdigest()


def write_atomic(path: Path, data: bytes | str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    mode = "wb" if isinstance(data, bytes) else "w"
    with open(tmp, mode) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)

