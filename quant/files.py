"""File primitives: content hashes and atomic writes. Torch-free, so the quantize command can start hashing the
source while torch is still loading; below every layer that writes (quant.ownership, the pipeline, the eval)."""

from __future__ import annotations

import hashlib
import mmap
import os
import tempfile
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


def git_blob_id(data: bytes) -> str:
    """The git blob id of `data`: how the Hub names a file it does not keep in LFS (a config, an index, a card)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_atomic(path: Path, data: bytes | str, tmp_dir: Path | None = None) -> None:
    """Write `path` through a temporary of a fresh, exclusively created name (in `tmp_dir`, by default beside it)
    renamed into place: no file of anyone else's is ever written through, and the file gets the mode every other
    file gets (0666 minus the umask)."""
    directory = Path(tmp_dir or Path(path).parent)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".quant-write-", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        share_like_other_files(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def share_like_other_files(path: Path) -> None:
    """Give a file written by a library that creates it owner-only (safetensors' save_file: 0600) the mode every
    other file of the export gets (0666 minus the umask), so an engine running as another user can read it."""
    os.chmod(path, 0o666 & ~_umask())
