"""One file of a Hub repository into the run's source scratch directory, checked against the Hub's sha256.

`download(source, file, scratch)` runs huggingface_hub's `hf_hub_download` into `scratch` (its `local_dir` mode:
the partial download lives in `scratch/.cache/huggingface/download/` and is resumed with a range request, also
after a kill), pinned to the commit the plan was made from. huggingface_hub itself resumes a connection dropped
mid-file and waits out 429s; this module adds RETRIES more tries for what it gives up on (429 and 5xx, honouring
Retry-After, and network errors), then one line naming the file (`quant.hub.explain`, exit 2).

A file that cannot fit the free space left on the disk is refused before its download starts, and a disk that
fills during one is the OSError it is (exit 74), named by the file's path either way; the partial download stays
for the next run to resume.

Every LFS file is hashed once downloaded and compared with the sha256 the Hub lists for it; a mismatch deletes
the file and fetches it once more from the Hub itself (not from HF_HOME's cache, which huggingface_hub copies a
cached blob from: a corrupt cached blob would come back), and a second mismatch is a one-line error (exit 2). A
verified file gets a record (`scratch/.verified/<file>.sha256`), so a resumed run keeps it without hashing it again.
"""

from __future__ import annotations

import errno
import shutil
import time
import warnings
from pathlib import Path

from quant.errors import QuantError, naming
from quant.files import sha256_file, write_atomic
from quant.hub import HubCheckpoint, explain

RETRIES = 4  # more tries after huggingface_hub's own, on 429, 5xx and network errors
RETRY_STATUS = (408, 429, 500, 502, 503, 504)
VERIFIED_DIR = ".verified"
MAX_WAIT = 60.0  # seconds: the longest Retry-After honoured


def verified_record(scratch: Path, file: str) -> Path:
    return scratch / VERIFIED_DIR / (file + ".sha256")


def recorded_sha256(scratch: Path, file: str, size: int) -> str | None:
    """The sha256 a verified earlier download of `file` recorded, while the file is still there at its size."""
    path, record = scratch / file, verified_record(scratch, file)
    try:
        if path.is_file() and not path.is_symlink() and path.stat().st_size == size:
            return record.read_text().strip() or None
    except OSError:
        return None
    return None


def forget(scratch: Path, file: str) -> None:
    """Delete a downloaded source file and its record (both inside the scratch directory, never elsewhere)."""
    for path in (scratch / file, verified_record(scratch, file)):
        if path.is_file() and not path.is_symlink():
            path.unlink()


def download(source: HubCheckpoint, file: str, scratch: Path) -> tuple[Path, str]:
    """(the local path, its sha256) of `file` fetched into `scratch` and checked against the Hub's sha256."""
    expected = source.lfs_sha256.get(file)
    for attempt in range(2):
        require_room(scratch, file, source.file_size(file))
        try:
            path = _fetch(source, file, scratch, fresh=attempt > 0)
        except OSError as e:
            raise naming(e, scratch / file) from None  # the disk: full, read-only, permission (exit 74)
        digest = sha256_file(path)
        if expected is None or digest == expected:
            record = verified_record(scratch, file)
            record.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(record, digest + "\n", tmp_dir=record.parent)
            return path, digest
        forget(scratch, file)
        _forget_metadata(scratch, file)
    raise QuantError(f"{source.ref.label}/{file}: the downloaded bytes do not match the Hub's sha256 "
                     f"(expected {expected[:12]}.., got {digest[:12]}.. twice); the copy was deleted, nothing of "
                     f"it was used: run the same command again to fetch it anew")


def require_room(scratch: Path, file: str, size: int) -> None:
    """Refuse a download the disk has no room for (ENOSPC naming the file, exit 74), before it starts; a partial
    download already there counts as room."""
    partial = sum(p.stat().st_size for p in (scratch / ".cache" / "huggingface" / "download").glob(
        f"{file}.*.incomplete")) if (scratch / ".cache").is_dir() else 0
    free = shutil.disk_usage(scratch).free
    if free + partial < size:
        raise OSError(errno.ENOSPC, f"No space left on device: the source file needs {size / 1e6:.1f} MB, "
                                    f"{free / 1e6:.1f} MB are free (finished shards are kept: free some space and "
                                    f"run the same command again)", str(scratch / file))


def _fetch(source: HubCheckpoint, file: str, scratch: Path, fresh: bool = False) -> Path:
    from huggingface_hub import hf_hub_download

    for attempt in range(RETRIES + 1):
        try:
            with warnings.catch_warnings():  # its own free-space warning: require_room checked, ENOSPC says it
                warnings.filterwarnings("ignore", message="Not enough free disk space", category=UserWarning)
                return Path(hf_hub_download(source.ref.repo_id, file, revision=source.commit, local_dir=scratch,
                                            endpoint=source.endpoint, force_download=fresh))
        except Exception as e:  # noqa: BLE001  (huggingface_hub and httpx raise many types; explain() sorts them)
            if isinstance(e, OSError) and e.errno is not None:
                raise  # the disk: full, read-only, permission (exit 74, the path named)
            wait = _retry_wait(e, attempt)
            if wait is None or attempt == RETRIES:
                raise explain(e, source.ref, source.endpoint, file) from None
            time.sleep(wait)
    raise AssertionError("not reached")


def _retry_wait(e: BaseException, attempt: int) -> float | None:
    """Seconds to wait before trying again, or None when the error is not one to retry."""
    import httpx2

    cause = e
    while cause is not None and getattr(cause, "response", None) is None and (cause.__cause__ or cause.__context__):
        cause = cause.__cause__ or cause.__context__
    response = getattr(cause, "response", None)
    backoff = min(0.5 * 2 ** attempt, 8.0)
    if response is not None:
        if response.status_code not in RETRY_STATUS:
            return None
        after = (response.headers.get("Retry-After") or "").strip()
        return min(float(after), MAX_WAIT) if after.isdigit() else backoff
    if isinstance(cause, (httpx2.TransportError, OSError)) and not isinstance(cause, QuantError):
        return backoff
    return None


def _forget_metadata(scratch: Path, file: str) -> None:
    """Drop huggingface_hub's record of a download we deleted, so the next call fetches it again."""
    meta = scratch / ".cache" / "huggingface" / "download" / (file + ".metadata")
    if meta.is_file() and not meta.is_symlink():
        meta.unlink()
