"""Source shards fetched on demand from the Hub, beside the quantizing, within a disk budget.

`ShardFetcher` is the streamed run's source: one thread downloads the source files into OUT's own
`.quant-source/` in the order the shards still to make first need them (`quant.planning.needs`), at most
`look_ahead` shards ahead of the newest one a worker has asked for, and never past `budget` bytes: each file's
whole size is reserved before its download starts and released when the file is deleted, so the bytes on disk stay
below the reservations at every moment. A worker calls `ready(shard)` (blocks until every file the shard reads is
there and checked against the Hub's sha256, `quant.pipeline.download`) and the run calls `finished(shard)` once
the output shard is written: a source file is deleted when the last shard that reads it is written.

On entry (`prepare`) what an earlier, killed run left is sorted: a verified file the run still needs in its first
window is kept (no refetch; a file the record does not cover is hashed again), a partial download of such a file
is kept for huggingface_hub to resume, and everything else in the directory's downloads is deleted.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path

from quant.errors import QuantError
from quant.files import sha256_file
from quant.hub import HubCheckpoint
from quant.pipeline.download import download, forget, recorded_sha256, verified_record
from quant.planning.needs import SourceUse
from quant.planning.plan import ShardJob
from quant.units import decimal


class ShardFetcher:
    def __init__(self, source: HubCheckpoint, scratch: Path, todo: list[ShardJob], budget: int | None,
                 span: int, base_bytes: int = 0, fetched_whole: tuple[str, ...] = ()):
        self.source, self.scratch, self.todo, self.budget, self.span = source, scratch, todo, budget, span
        self.fetched_whole = set(fetched_whole)  # fetched before the shards and kept (a draft file): never forgotten
        self.use = SourceUse.of(todo)
        self.index = {s.file: i for i, s in enumerate(todo)}
        self.users = {f: sum(f in needs for needs in self.use.needs) for f in self.use.first}
        self.hashes: dict[str, Future] = {f: Future() for f in self.use.first}
        self.cond = threading.Condition()
        self.asked = 0  # the newest shard (index in todo) a worker has asked for
        self.reserved = self.peak = base_bytes  # bytes on disk or promised to a download under way
        self.stopped = False
        self.fetched_bytes, self.fetch_s, self.fetched, self.kept = 0, 0.0, 0, 0
        self.prereserved: set[str] = set()  # partial downloads kept by prepare, their whole size reserved there
        self.started = time.perf_counter()
        self.thread = threading.Thread(target=self._run, name="quant-fetch", daemon=True)

    # ---- the run's side ---------------------------------------------------------------------------------------
    def __enter__(self) -> "ShardFetcher":
        self.prepare()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        self.thread.join(timeout=0 if exc[0] is not None else None)

    def source_hash(self, shard: ShardJob) -> Future:
        return self.hashes[shard.source_file]

    def ready(self, shard: ShardJob) -> None:
        """Block until every source file `shard` reads is on disk and verified (raises the fetch's error)."""
        with self.cond:
            self.asked = max(self.asked, self.index[shard.file])
            self.cond.notify_all()
        for f in self.use.needs[self.index[shard.file]]:
            self.hashes[f].result()

    def finished(self, shard: ShardJob) -> None:
        """`shard` is written: delete each source file no shard still to make reads."""
        for f in self.use.needs[self.index[shard.file]]:
            with self.cond:
                self.users[f] -= 1
                last = self.users[f] == 0
            if last:
                forget(self.scratch, f)
                self._release(self.source.file_size(f))

    # ---- budget ------------------------------------------------------------------------------------------------
    def _reserve(self, nbytes: int, first: int) -> bool:
        """Wait until the file first needed by shard `first` is within the look-ahead and fits; False if stopped."""
        with self.cond:
            while not self.stopped and (first > self.asked + self.span - 1 or (
                    self.budget is not None and self.reserved + nbytes > self.budget)):
                self.cond.wait()
            if self.stopped:
                return False
            self.reserved += nbytes
            self.peak = max(self.peak, self.reserved)
            return True

    def _release(self, nbytes: int) -> None:
        with self.cond:
            self.reserved -= nbytes
            self.cond.notify_all()

    # ---- the downloading thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            for f in self.use.order():
                if self.hashes[f].done():
                    continue  # kept from an earlier run (prepare)
                if f not in self.prereserved and not self._reserve(self.source.file_size(f), self.use.first[f]):
                    return
                t0 = time.perf_counter()
                _, digest = download(self.source, f, self.scratch)
                self.fetch_s += time.perf_counter() - t0
                self.fetched_bytes += self.source.file_size(f)
                self.fetched += 1
                self.hashes[f].set_result(digest)
        except BaseException as e:  # noqa: BLE001  every waiting worker gets the error, one line
            for future in self.hashes.values():
                if not future.done():
                    future.set_exception(e if isinstance(e, (QuantError, OSError)) else QuantError(str(e)))

    # ---- an earlier run's leftovers ----------------------------------------------------------------------------
    def prepare(self) -> None:
        """Keep what an earlier run fetched and this one needs first; delete the rest of the downloads."""
        self.scratch.mkdir(exist_ok=True)
        repo_files = [f for f in self.source.sizes if f.endswith(".safetensors") and f not in self.fetched_whole]
        for f in repo_files:
            size = self.source.file_size(f)
            keep = f in self.use.first and self.use.first[f] < self.span
            digest = recorded_sha256(self.scratch, f, size) if keep else None
            if keep and digest is None and not verified_record(self.scratch, f).exists():
                digest = self._rehash(f, size)
            if keep and digest is not None and digest == self.source.lfs_sha256.get(f, digest):
                self.hashes[f].set_result(digest)
                self.reserved += size
                self.kept += 1
            else:
                forget(self.scratch, f)
        self.peak = max(self.peak, self.reserved)
        self._sort_partials()

    def _rehash(self, f: str, size: int) -> str | None:
        """The sha256 of a complete download whose record a kill prevented (None: no such file)."""
        path = self.scratch / f
        if not path.is_file() or path.is_symlink() or path.stat().st_size != size:
            return None
        return sha256_file(path)

    def _sort_partials(self) -> None:
        """Keep a partial download of a file needed in the first window (reserved now, resumed by its download);
        delete every other one."""
        downloads = self.scratch / ".cache" / "huggingface" / "download"
        partials = {p for p in downloads.rglob("*.incomplete")} if downloads.is_dir() else set()
        for f in self.use.order():
            if self.use.first[f] >= self.span or self.hashes[f].done():
                continue
            for p in _partials_of(self.scratch, f, self.source.lfs_sha256.get(f)):
                if p in partials and self._fits(self.source.file_size(f)):
                    partials.discard(p)
                    self.reserved += self.source.file_size(f)
                    self.prereserved.add(f)
        self.peak = max(self.peak, self.reserved)
        for p in partials:
            if p.is_file() and not p.is_symlink():
                p.unlink()

    def _fits(self, nbytes: int) -> bool:
        return self.budget is None or self.reserved + nbytes <= self.budget

    # ---- what it did -------------------------------------------------------------------------------------------
    def status(self) -> str:
        rate = self.fetched_bytes / self.fetch_s / 1e6 if self.fetch_s else 0.0
        limit = f" of {decimal(self.budget)}" if self.budget is not None else ""
        return f"download {rate:.1f} MB/s, disk {decimal(self.reserved)}{limit}"

    def summary(self) -> dict:
        return {"fetched_files": self.fetched,
                "kept_files": self.kept, "fetched_bytes": self.fetched_bytes, "fetch_s": round(self.fetch_s, 3),
                "peak_disk_bytes": self.peak, "budget_bytes": self.budget}


def _partials_of(scratch: Path, file: str, etag: str | None) -> list[Path]:
    """Where huggingface_hub keeps the partial download of `file` in `scratch` (its local_dir layout)."""
    if not etag:
        return []
    try:
        from huggingface_hub._local_folder import get_local_download_paths

        return [get_local_download_paths(scratch, file).incomplete_path(etag)]
    except Exception:  # noqa: BLE001  a huggingface_hub without that layout: no partial is kept
        return []
