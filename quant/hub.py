"""Checkpoints on the Hugging Face Hub, read where they are: `quant verify-manifest ORG/NAME[@REVISION]`.

`open_hub_checkpoint(HubRef("org/name", "v1"))` returns the same `Checkpoint` that `open_checkpoint` builds from a
local copy (quant.checkpoint.build_checkpoint, fed with the same config.json, index and shard headers), so every
check finds the same problems; only the names in messages differ ("org/name@v1/model-00001-of-00009.safetensors"
for "/data/ckpt/model-00001-of-00009.safetensors"). Nothing but metadata is read:

  1. model info at the revision (one request): the commit every later read is pinned to, and the file list
     with sizes (which shards exist, the repository's size);
  2. config.json and the index with `hf_hub_download` (two small files, cached in HF_HOME like any download);
  3. each shard's header with one HTTP range request (`Range: bytes=0-N`, N from the index's tensor names, a
     second request only when the header is longer), 16 in flight, validated as the safetensors library does;
  4. with --scales, only the scale tensors' byte ranges (`HubCheckpoint.open_shard`, quant.verify.scales).

Requests go through huggingface_hub's own HTTP session, headers and error types (HF_ENDPOINT, HF_TOKEN or the
stored login, proxies). A shard's later reads go straight to the storage URL the Hub redirected its first one to
(without the token), the Hub asked again once that signed URL has expired. A range request is retried RETRIES
times on connection errors, 429 and 5xx; the first that fails for good stops the others, and every failure to
reach or read the Hub is a one-line QuantError (exit 2). `HubCheckpoint.traffic` counts requests and response
bytes.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

from quant.checkpoint import INDEX_FILE, SINGLE_FILE, Checkpoint, build_checkpoint, is_safe_relative, read_json
from quant.errors import QuantError, UnreadableCheckpoint, machine_failure, naming
from quant.files import git_blob_id
from quant.safetensors_header import DTYPE_BITS, MAX_HEADER, parse_header  # noqa: F401  (re-exported)

__all__ = ["HubRef", "HubCheckpoint", "Traffic", "hub_reference", "open_hub_checkpoint", "parse_header"]

# A Hub repository id (huggingface_hub's validate_repo_id: `namespace/name` of [\w.-], at most 96 characters
# each), with an optional @revision (a branch, tag, commit or refs/pr/N).
REPO_REF = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96})(?:@(?P<rev>[^@\s]+))?$")
IN_FLIGHT = 16  # concurrent range requests
RETRIES = 3  # per range request, on connection errors, 429 and 5xx
RETRY_STATUS = (429, 500, 502, 503, 504)
# Bytes of header JSON per tensor beyond its name and its two offsets: "":{"dtype":"BF16","shape":[..],
# "data_offsets":[,]}, with room for three dimensions (within 15 % above the headers safetensors writes, never
# below them, on the toys and a GLM-5.2-sized export; a header longer than guessed costs one more request).
HEADER_ENTRY = 64
UNINDEXED_HEADER = 100_000  # first read of a shard no index describes (huggingface_hub's own guess)

@dataclass(frozen=True)
class HubRef:
    repo_id: str
    revision: str | None = None  # None: the default branch

    @property
    def label(self) -> str:
        return f"{self.repo_id}@{self.revision}" if self.revision else self.repo_id


def hub_reference(arg: str | os.PathLike) -> HubRef | None:
    """The Hub repository `arg` names (ORG/NAME or ORG/NAME@REVISION), or None: a path that exists, or one that
    does not look like a repository id, is a local checkpoint."""
    text = os.fspath(arg)
    if os.path.lexists(text):
        return None
    m = REPO_REF.match(text)
    if m is None or ".." in m.group("repo") or "--" in m.group("repo"):
        return None
    return HubRef(m.group("repo"), m.group("rev"))


# ---- traffic -------------------------------------------------------------------------------------------------

@dataclass
class Traffic:
    """Requests sent and response body bytes received (as on the wire, redirects included) by the process's
    huggingface_hub session while a HubCheckpoint is open."""

    requests: int = 0
    bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, requests: int = 0, nbytes: int = 0) -> None:
        with self.lock:
            self.requests += requests
            self.bytes += nbytes

    def hook(self, response) -> None:
        """An httpx response event hook: counts the request, and the body's bytes as they are read."""
        import httpx2

        traffic = self

        class Counted(httpx2.SyncByteStream):
            def __init__(self, inner):
                self.inner = inner

            def __iter__(self):
                for chunk in self.inner:
                    traffic.add(nbytes=len(chunk))
                    yield chunk

            def close(self) -> None:
                self.inner.close()

        self.add(requests=1)
        if isinstance(response.stream, httpx2.SyncByteStream):
            response.stream = Counted(response.stream)


# ---- the repository ------------------------------------------------------------------------------------------

class _Repo:
    """One revision of a Hub repository, pinned to its commit: range reads of its files."""

    def __init__(self, ref: HubRef, endpoint: str, commit: str, sizes: dict[str, int | None]):
        from huggingface_hub.utils import build_hf_headers

        self.ref, self.endpoint, self.commit, self.sizes = ref, endpoint, commit, sizes
        self.headers = {**build_hf_headers(), "Accept-Encoding": "identity"}
        self.direct: dict[str, str] = {}  # file -> the URL the Hub redirected its bytes to (its storage)
        self.layouts: dict[str, tuple[int, dict]] = {}  # file -> (data start, name -> (begin, end))
        self.pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="quant-hub")
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.blob_ids: dict[str, str] = {}  # file -> the git blob id the Hub lists (small, non-LFS files)
        self.error: QuantError | None = None  # the first request that failed for good

    def url(self, file: str) -> str:
        from huggingface_hub import hf_hub_url

        return hf_hub_url(self.ref.repo_id, file, revision=self.commit, endpoint=self.endpoint)

    def read(self, file: str, begin: int, end: int) -> tuple[bytes, int]:
        """Bytes [begin, end) of `file` and the file's size. From the storage URL the Hub redirected to before
        (no token sent off the Hub), else (or once that has expired) through the Hub's resolve URL."""
        if end <= begin:  # an empty tensor: nothing to ask for
            return b"", self.sizes.get(file) or 0
        direct = self.direct.get(file)
        if direct is not None:
            try:
                return self._get(direct, file, begin, end, hub=False)
            except _Expired:
                self.direct.pop(file, None)
        return self._get(self.url(file), file, begin, end, hub=True)

    def _get(self, url: str, file: str, begin: int, end: int, hub: bool) -> tuple[bytes, int]:
        """One range request, retried RETRIES times on connection errors, 429 and 5xx (0.5 s, 1 s, 2 s apart);
        the first failure that is not retried, or outlasts the retries, stops every other request too."""
        import httpx2
        from huggingface_hub import constants
        from huggingface_hub.utils import get_session, hf_raise_for_status

        headers = dict(self.headers)
        if not hub and _origin(url) != _origin(self.endpoint):
            headers.pop("authorization", None)
            headers.pop("Authorization", None)
        headers["Range"] = f"bytes={begin}-{end - 1}"
        for attempt in range(RETRIES + 1):
            if self.error is not None:
                raise QuantError(str(self.error))
            try:
                with get_session().stream("GET", url, headers=headers,
                                          timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as r:
                    if r.status_code >= 400:
                        r.read()
                        if not hub and r.status_code in (401, 403, 404, 410):
                            raise _Expired()
                        if r.status_code == 416:  # a range past the end: an empty or shorter file
                            return b"", _content_range_total(r.headers.get("Content-Range")) or 0
                        if r.status_code in RETRY_STATUS and attempt < RETRIES:
                            self._pause(attempt)
                            continue
                        hf_raise_for_status(r)
                    if hub and str(r.url) != url:
                        self.direct[file] = str(r.url)
                    if r.status_code == 206:
                        data = r.read()
                        total = _content_range_total(r.headers.get("Content-Range"))
                        return data, total if total is not None else begin + len(data)
                    # 200: a server that ignores ranges sends the whole file; read only what was asked
                    total = int(r.headers.get("Content-Length") or 0)
                    buf = bytearray()
                    for chunk in r.iter_bytes():
                        buf += chunk
                        if len(buf) >= end:
                            break
                    return bytes(buf[begin:end]), max(total, len(buf))
            except (_Expired, QuantError):
                raise
            except (httpx2.TimeoutException, httpx2.NetworkError, httpx2.RemoteProtocolError) as e:
                if attempt < RETRIES:
                    self._pause(attempt)
                    continue
                raise self._fail(e, file) from None
            except (httpx2.HTTPError, OSError) as e:
                raise self._fail(e, file) from None
        raise QuantError(str(self.error))  # not reached: the last attempt returns or raises

    def _pause(self, attempt: int) -> None:
        if self.stop.wait(min(0.5 * 2 ** attempt, 4)):  # woken early: another request failed for good
            raise QuantError(str(self.error))

    def _fail(self, e: BaseException, file: str) -> QuantError:
        error = explain(e, self.ref, self.endpoint, file)
        with self.lock:
            if self.error is None:
                self.error = error
        self.stop.set()
        return QuantError(str(self.error))

    def fetch_header(self, file: str, guess: int):
        """The parsed header of `file` (parse_header), None when the repository has no such file, or the
        ValueError that makes it unreadable (a finding, as on a local copy)."""
        if file not in self.sizes:
            return None
        size = self.sizes[file]
        first = max(16, min(guess, size) if size is not None else guess)
        data, total = self.read(file, 0, first) if size != 0 else (b"", 0)
        if len(data) >= 8:
            n = struct.unpack("<Q", data[:8])[0]
            if len(data) < 8 + n <= min(total, 8 + MAX_HEADER):
                rest, total = self.read(file, len(data), 8 + n)
                data += rest
        try:
            header, start, offsets = parse_header(data, total)
        except ValueError as e:
            return e
        self.layouts[file] = (start, offsets)
        return header

    def close(self) -> None:
        self.stop.set()
        self.pool.shutdown(wait=False, cancel_futures=True)


class _Expired(Exception):
    """A storage URL the Hub redirected to answered 4xx (a signed URL past its expiry)."""


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme, parts.netloc.lower()


def _content_range_total(value: str | None) -> int | None:
    m = re.match(r"^bytes (?:\d+-\d+|\*)/(\d+)$", (value or "").strip())
    return int(m.group(1)) if m else None


class _HubShard:
    """quant.verify.scales' view of one shard: its layout from the header already read, and `read(ranges)` the
    bytes of (position, length) ranges in order, IN_FLIGHT requests at a time (adjacent ranges in one)."""

    def __init__(self, repo: _Repo, file: str):
        self.repo, self.file = repo, file
        self.start, self.offsets = repo.layouts[file]

    def read(self, ranges):
        runs: list[tuple[int, int, list[tuple[int, int]]]] = []  # (begin, end, the ranges it holds)
        for pos, length in ranges:
            if runs and runs[-1][1] == pos:
                runs[-1] = (runs[-1][0], pos + length, runs[-1][2] + [(pos, length)])
            else:
                runs.append((pos, pos + length, [(pos, length)]))
        pending: deque = deque()
        it = iter(runs)
        for run in it:
            pending.append((run, self.repo.pool.submit(self.repo.read, self.file, run[0], run[1])))
            if len(pending) >= IN_FLIGHT:
                break
        while pending:
            (begin, _, parts), future = pending.popleft()
            data, _ = future.result()
            nxt = next(it, None)
            if nxt is not None:
                pending.append((nxt, self.repo.pool.submit(self.repo.read, self.file, nxt[0], nxt[1])))
            for pos, length in parts:
                yield data[pos - begin:pos - begin + length]

    def close(self) -> None:
        pass


@dataclass
class HubCheckpoint(Checkpoint):
    """A Checkpoint whose root is a Hub repository ("org/name@rev", for messages): its headers were read over
    HTTP, its scale bytes are read the same way (`open_shard`), and it has no local files."""

    ref: HubRef | None = None
    endpoint: str = ""
    commit: str = ""
    sizes: dict = field(default_factory=dict)  # every file of the repository -> its size
    lfs_sha256: dict = field(default_factory=dict)  # every LFS file of the repository -> the Hub's sha256 of it
    traffic: Traffic = field(default_factory=Traffic)
    repo: _Repo | None = field(default=None, repr=False)

    def shard_path(self, file: str) -> PurePosixPath:
        return self.root / file

    def file_size(self, file: str) -> int:
        return self.sizes.get(file) or 0

    def total_bytes(self) -> int:
        return sum(self.sizes.get(f) or 0 for f in self.files)

    def repo_bytes(self) -> int:
        return sum(size or 0 for size in self.sizes.values())

    def has_file(self, name: str) -> bool:
        return name in self.sizes

    def file_header(self, name: str) -> dict:
        header = self.repo.fetch_header(name, UNINDEXED_HEADER) if self.repo is not None else None
        if header is None:
            raise OSError(f"{self.root / name}: no such file in the repository")
        if isinstance(header, Exception):
            raise header
        return header

    def open_shard(self, file: str) -> _HubShard:
        return _HubShard(self.repo, file)

    def summary(self) -> dict:
        return {"repo": self.ref.repo_id, "revision": self.ref.revision, "commit": self.commit,
                "endpoint": self.endpoint, "requests": self.traffic.requests, "bytes": self.traffic.bytes,
                "repo_bytes": self.repo_bytes()}

    def traffic_line(self) -> str:
        total = self.repo_bytes()
        share = f" ({100 * self.traffic.bytes / total:.2g}% of its {_mb(total)})" if total else ""
        return (f"hub: {self.ref.label} at commit {self.commit[:12]}: {self.traffic.requests} requests, "
                f"{_mb(self.traffic.bytes)} read{share}")

    def close(self) -> None:
        """Stop counting and release the request threads."""
        _count(self.traffic, False)
        if self.repo is not None:
            self.repo.close()


def _mb(n: int) -> str:
    return f"{n / 1e6:.3g} MB" if n >= 100_000 else f"{n / 1e3:.3g} kB"


# ---- opening ---------------------------------------------------------------------------------------------------

def open_hub_checkpoint(ref: HubRef) -> HubCheckpoint:
    """The Checkpoint of the Hub repository `ref` from its config.json, index and shard headers (see the module
    docstring). Raises QuantError (exit 2), one line, when the Hub cannot be reached or refuses, the repository
    or revision does not exist, or a read fails; UnreadableCheckpoint as open_checkpoint does."""
    from huggingface_hub import HfApi, constants

    api = HfApi()
    endpoint = api.endpoint
    if constants.HF_HUB_OFFLINE:
        raise QuantError(f"{ref.label}: no local directory of that name, and the Hub is offline (HF_HUB_OFFLINE=1): "
                         f"unset it to read the repository's headers from {endpoint}, or give a local copy")
    traffic = Traffic()
    _count(traffic, True)
    try:
        return _open(api, ref, endpoint, traffic)
    except BaseException:
        _count(traffic, False)
        raise


_QUIET: dict = {}


def _count(traffic: Traffic, on: bool) -> None:
    """Count (or stop counting) the requests of huggingface_hub's shared HTTP session in `traffic`; meanwhile
    huggingface_hub logs errors only (no retry notices or progress bars around the one line a failure prints),
    unless HF_HUB_VERBOSITY asks for more."""

    from huggingface_hub.utils import get_session

    session = get_session()
    hooks = session.event_hooks
    hooks["response"] = [h for h in hooks["response"] if h != traffic.hook] + ([traffic.hook] if on else [])
    session.event_hooks = hooks
    if os.environ.get("HF_HUB_VERBOSITY"):
        return
    logger = logging.getLogger("huggingface_hub")
    if on and id(traffic) not in _QUIET:
        _QUIET[id(traffic)] = logger.level
        logger.setLevel(max(logger.getEffectiveLevel(), logging.ERROR))
    elif not on and id(traffic) in _QUIET:
        logger.setLevel(_QUIET.pop(id(traffic)))


def _open(api, ref: HubRef, endpoint: str, traffic: Traffic) -> HubCheckpoint:
    try:
        info = api.model_info(ref.repo_id, revision=ref.revision, files_metadata=True)
    except Exception as e:
        raise explain(e, ref, endpoint) from None
    sizes = {s.rfilename: s.size for s in info.siblings or []}
    lfs = {s.rfilename: s.lfs.sha256 for s in info.siblings or [] if getattr(s, "lfs", None) is not None}
    repo = _Repo(ref, endpoint, info.sha or ref.revision or "main", sizes)
    repo.blob_ids = {s.rfilename: s.blob_id for s in info.siblings or []
                     if getattr(s, "blob_id", None) and getattr(s, "lfs", None) is None}
    root = PurePosixPath(ref.label)
    try:
        config = _json(api, repo, "config.json", root)
        index = _json(api, repo, INDEX_FILE, root) if INDEX_FILE in sizes else None
        files = None
        if index is None:
            if SINGLE_FILE in sizes:
                files = [SINGLE_FILE]
            else:
                files = sorted(f for f in sizes if "/" not in f and f.endswith(".safetensors"))
                if not files:
                    raise UnreadableCheckpoint(f"{root}: no {INDEX_FILE} and no *.safetensors files")
        guesses: dict[str, int] = {}
        weight_map = index.get("weight_map") if index is not None else None
        if isinstance(weight_map, dict):
            for name, file in weight_map.items():
                digits = len(str(sizes.get(str(file)) or 10 ** 10))
                guesses[str(file)] = guesses.get(str(file), 64) + len(str(name).encode()) + HEADER_ENTRY + 2 * digits
            wanted = sorted(f for f in guesses if is_safe_relative(f))
        else:
            wanted = files or []
        headers = dict(zip(wanted, repo.pool.map(
            lambda f: repo.fetch_header(f, guesses.get(f, UNINDEXED_HEADER)), wanted)))
    except BaseException:
        repo.close()
        raise

    def read_header(file: str):
        header = headers.get(file)
        if isinstance(header, Exception):
            raise header
        return header

    base = build_checkpoint(root, root, config, index, files, read_header)
    return HubCheckpoint(**{f.name: getattr(base, f.name) for f in fields(Checkpoint)}, ref=ref,
                         endpoint=endpoint, commit=repo.commit, sizes=sizes, lfs_sha256=lfs, traffic=traffic,
                         repo=repo)


def _json(api, repo: _Repo, file: str, root: PurePosixPath) -> dict:
    """config.json or the index, downloaded with hf_hub_download (cached in HF_HOME) and read as
    open_checkpoint reads a local one (the same messages, naming the file in the repository)."""
    from huggingface_hub.errors import RemoteEntryNotFoundError

    if file not in repo.sizes:
        raise UnreadableCheckpoint(f"{root / file}: file not found")
    local = None
    for fresh in (False, True):  # a cached copy whose bytes are not the Hub's is fetched once more
        try:
            local = api.hf_hub_download(repo.ref.repo_id, file, revision=repo.commit, force_download=fresh)
        except RemoteEntryNotFoundError:
            raise UnreadableCheckpoint(f"{root / file}: file not found") from None
        except Exception as e:
            raise cache_failure(e) or explain(e, repo.ref, repo.endpoint, file) from None
        if cached_as_listed(Path(local), repo.blob_ids.get(file)):
            break
    else:
        raise QuantError(f"{Path(local).resolve()}: the cached {file} of {repo.ref.label} is still not the Hub's "
                         f"bytes after a fresh download (check the disk under HF_HOME)")
    try:
        return read_json(Path(local))
    except UnreadableCheckpoint as e:
        raise UnreadableCheckpoint(str(e).replace(str(local), str(root / file))) from None


def cached_as_listed(path: Path, blob_id: str | None) -> bool:
    """Whether a file in the HF cache holds the bytes the Hub lists for it (its git blob id; None: not listed)."""
    try:
        return blob_id is None or git_blob_id(path.read_bytes()) == blob_id
    except OSError:
        return False


def cache_failure(e: BaseException) -> OSError | None:
    """The machine's failure behind what huggingface_hub raised while writing its cache (a full or read-only
    HF_HOME: exit 74), naming the cache directory when the error names no path; None for anything else."""
    from huggingface_hub import constants

    machine = machine_failure(e)
    return naming(machine, constants.HF_HUB_CACHE) if machine is not None else None


def explain(e: BaseException, ref: HubRef, endpoint: str, file: str | None = None) -> QuantError:
    """One line for what huggingface_hub (or the network under it) raised while reading `ref` (`file` in it)."""
    import httpx2
    from huggingface_hub import errors

    where = ref.label
    reading = f" reading {file}" if file else ""
    page = f"{endpoint}/{ref.repo_id}"
    cause = e
    while isinstance(cause, errors.LocalEntryNotFoundError) and (cause.__cause__ or cause.__context__):
        cause = cause.__cause__ or cause.__context__  # hf_hub_download hides the network error under it
    status = getattr(getattr(cause, "response", None), "status_code", None)
    if isinstance(cause, errors.OfflineModeIsEnabled):
        return QuantError(f"{where}: no local directory of that name, and the Hub is offline (HF_HUB_OFFLINE=1): "
                          f"unset it to read the repository's headers from {endpoint}, or give a local copy")
    if isinstance(cause, errors.GatedRepoError):
        if status == 401:
            return QuantError(f"{where}: a gated repository and no token was sent (401){reading}: accept its "
                              f"terms at {page} and set HF_TOKEN (or run `hf auth login`)")
        return QuantError(f"{where}: a gated repository and the token's account has no access ({status}){reading}: "
                          f"accept its terms at {page} with that account, or use a token of one that has")
    if isinstance(cause, errors.RevisionNotFoundError):
        return QuantError(f"{where}: the repository {ref.repo_id} has no revision '{ref.revision}' (a branch, "
                          f"tag or commit) on {endpoint}")
    if isinstance(cause, errors.RepositoryNotFoundError):
        from huggingface_hub.utils import get_token

        private = ("private and HF_TOKEN has no access to it" if get_token() else
                   "private and no token was sent: set HF_TOKEN or run `hf auth login`")
        return QuantError(f"{where}: no local directory of that name, and no model repository {ref.repo_id} on "
                          f"{endpoint} (HTTP {status}: it does not exist, or it is {private})")
    if isinstance(cause, errors.RemoteEntryNotFoundError):
        return QuantError(f"{where}: {file or 'a file'} is not in the repository at {ref.revision or 'main'}")
    if isinstance(cause, errors.HfHubHTTPError) and status is not None:
        reason = getattr(cause.response, "reason_phrase", "") or ""
        detail = (getattr(cause, "server_message", None) or "").strip().splitlines()
        detail = f": {detail[0][:200]}" if detail else ""
        if status in (401, 403):
            return QuantError(f"{where}: the Hub refused access ({status} {reason}){reading}{detail}; check that "
                              f"HF_TOKEN (or `hf auth login`) is a token with access to {ref.repo_id}")
        return QuantError(f"{where}: the Hub answered {status} {reason}{reading}{detail}")
    if isinstance(cause, (httpx2.HTTPError, OSError, errors.LocalEntryNotFoundError)):
        first = (str(cause).splitlines() or [""])[0][:200] or type(cause).__name__
        return QuantError(f"{where}: network failure{reading} from {endpoint} ({type(cause).__name__}: {first}); "
                          f"check the connection, HF_ENDPOINT and proxy settings, then run it again")
    first = (str(cause).splitlines() or [""])[0][:200]
    return QuantError(f"{where}: cannot read it from {endpoint}{reading} ({type(cause).__name__}: {first})")
