"""User-facing errors.

Every failure a user can cause (bad input file, missing tensor, wrong option) is raised as a `QuantError`
whose message is one line naming the file, tensor or key. The CLI prints it without a traceback and exits with
the error's `exit_code`, from the table in the README:

  1  EngineFailure: an engine would fail or load wrong weights (the self-check, config/tensor disagreements)
  2  QuantError: a bad argument or unreadable input, found before any work
  4  `quant eval`: the verdict is `invalid` (an arm at or below the floor, or accuracy and acceptance disagree)
 69  EvidenceMissing: `quant eval` could not get the answers it needs (a server arm's requests failed)
 75  RankLost: a GPTQ run on several torch.distributed ranks lost one of them (the same command resumes)
"""

import difflib
import errno
import os
from collections.abc import Iterable

# The machine failing a write, wherever it surfaces: disk full, quota, read-only filesystem, permission.
MACHINE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}


def machine_failure(e: BaseException | None) -> OSError | None:
    """The OSError of the machine's own making behind `e` (itself, or its cause or context chain), if any:
    libraries wrap them (datasets' DatasetGenerationError around errno 28, for one)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in MACHINE_ERRNOS:
            return e
        code = _SQLITE_ERRNOS.get(getattr(e, "sqlite_errorcode", -1))  # sqlite3 says it in its own codes
        if code is not None:
            return OSError(code, os.strerror(code))
        e = e.__cause__ or e.__context__
    return None


# SQLITE_FULL, SQLITE_READONLY, SQLITE_IOERR, SQLITE_PERM (sqlite3.OperationalError.sqlite_errorcode, Python 3.11+):
# the machine's failures when a cache database is written (the eval's answers, datasets' caches).
_SQLITE_ERRNOS = {13: errno.ENOSPC, 8: errno.EROFS, 10: errno.EIO, 3: errno.EPERM}


def naming(failure: OSError, where: object) -> OSError:
    """`failure` as an OSError that names a path: its own, else `where` (the directory being written)."""
    if failure.filename is not None:
        return failure
    return OSError(failure.errno, failure.strerror or os.strerror(failure.errno or 0), str(where))


def did_you_mean(value: str, choices: Iterable[str]) -> str:
    """` (did you mean 'x'?)` for the closest of `choices` to a mistyped `value`, or "" when none is close."""

    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
    if not close:
        lowered = {str(c).lower(): str(c) for c in choices}
        close = [lowered[str(value).lower()]] if str(value).lower() in lowered else []
    return f" (did you mean {close[0]!r}?)" if close else ""


class QuantError(Exception):
    """A problem with the user's input (a bad argument, an unreadable or invalid file), reported as one line."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class UnreadableCheckpoint(QuantError):
    """The checkpoint cannot be read at all (no config.json, corrupt header, ...)."""

    exit_code = 2


class EngineFailure(QuantError):
    """An engine would fail to load the checkpoint, or load wrong weights."""

    exit_code = 1


class EvidenceMissing(QuantError):
    """`quant eval` has no verdict to give: an arm's requests failed beyond the tolerance (sysexits
    EX_UNAVAILABLE)."""

    exit_code = 69


class RankLost(QuantError):
    """A GPTQ run on torch.distributed ranks lost one of them (killed, or silent beyond the collective timeout): the
    layers finished so far are kept, and the same command resumes from them (sysexits EX_TEMPFAIL: try again)."""

    exit_code = 75
