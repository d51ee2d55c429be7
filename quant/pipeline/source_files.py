"""Where a run's source shards come from while it quantizes: a local directory (hashed beside the quantizing), or
a Hub repository streamed into OUT's own `.quant-source/` (fetched on demand, deleted once used).

Both give the run the same four things: `ckpt` (the checkpoint its readers open: local paths), `root` (the
directory the side files are copied from), `source_hash(shard)` (a Future of the source shard's sha256, for the
manifest), and the hooks `ready(shard)` (before a worker reads it) and `finished(shard)` (once its output shard
is written)."""

from __future__ import annotations

import fnmatch
import json
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path

from quant.checkpoint import Checkpoint
from quant.errors import QuantError
from quant.families import family_for_config
from quant.files import sha256_file, write_atomic
from quant.hub import HubCheckpoint, HubRef, hub_reference
from quant.pipeline.download import VERIFIED_DIR, download
from quant.pipeline.fetch import ShardFetcher
from quant.pipeline.output import OWN_FILES, SOURCE_DIR, read_record
from quant.pipeline.shard_records import ShardResult
from quant.pipeline.sidecars import sidecar_files_present
from quant.planning.needs import SourceUse, required_disk
from quant.planning.plan import Plan, ShardJob
from quant.planning.source import HUB_PATTERNS


class LocalFiles:
    """A source directory on disk: each shard still to make has its source hashed on a thread of its own (one per
    worker, so hashing keeps up with several devices), in shard order, from before torch loads."""

    status = None

    def __init__(self, ckpt: Checkpoint, root: Path, todo: list[ShardJob], workers: int):
        self.ckpt, self.root, self.todo, self.workers = ckpt, root, todo, workers

    def __enter__(self) -> "LocalFiles":
        self.pool = ThreadPoolExecutor(max_workers=self.workers)
        self.hashes = {s.file: self.pool.submit(sha256_file, self.ckpt.shard_path(s.source_file)) for s in self.todo}
        return self

    def __exit__(self, *exc) -> None:
        for future in self.hashes.values():
            future.cancel()  # after a failure, shards never started need no hash
        self.pool.shutdown(wait=True)

    def source_hash(self, shard: ShardJob) -> Future:
        return self.hashes[shard.file]

    def ready(self, shard: ShardJob) -> None:
        pass

    def finished(self, shard: ShardJob) -> None:
        pass

    def summary(self) -> dict | None:
        return None


class HubFiles:
    """A Hub repository streamed into `out/.quant-source/` (quant.pipeline.fetch): the side files first, then
    the source shards within `budget` bytes, `look_ahead` shards ahead of the workers."""

    def __init__(self, source: HubCheckpoint, out: Path, todo: list[ShardJob], workers: int, budget: int | None,
                 look_ahead: int, log=print):
        self.source, self.todo, self.budget, self.log = source, todo, budget, log
        self.root = out / SOURCE_DIR
        self.span = workers + look_ahead
        self.ckpt = local_view(source, self.root)
        self.fetcher: ShardFetcher | None = None

    def __enter__(self) -> "HubFiles":
        self.root.mkdir(exist_ok=True)
        drafts = draft_file_names(self.source)
        names = side_file_names(self.source) + drafts
        for name in names:
            download(self.source, name, self.root)
        side = sum(self.source.file_size(n) for n in names)
        self.fetcher = ShardFetcher(self.source, self.root, self.todo, self.budget, self.span, base_bytes=side,
                                    fetched_whole=tuple(drafts))
        self.fetcher.__enter__()
        if self.fetcher.kept:
            self.log(f"resuming: {self.fetcher.kept} source shard(s) fetched and verified by the earlier run kept")
        return self

    def __exit__(self, *exc) -> None:
        self.fetcher.__exit__(*exc)

    def source_hash(self, shard: ShardJob) -> Future:
        return self.fetcher.source_hash(shard)

    def ready(self, shard: ShardJob) -> None:
        self.fetcher.ready(shard)

    def finished(self, shard: ShardJob) -> None:
        self.fetcher.finished(shard)

    def status(self) -> str:
        return self.fetcher.status()

    def summary(self) -> dict:
        return self.fetcher.summary()


# The sha256 of every LFS file at the commit the run read, beside the download records (bookkeeping, not source
# bytes: outside --max-disk's count).
HUB_RECORD = f"{VERIFIED_DIR}/hub-sha256.json"


class HubChanges:
    """What changed on the Hub since an earlier run into OUT read it (a repository updated between a kill and the
    resume): `stale(shard, result)` says a finished shard read a source file whose sha256 on the Hub is no longer
    the one it was made from, so it is redone. The earlier run's view is its record of the Hub's sha256s
    (`.quant-source/.verified/hub-sha256.json`, written before its first shard; every source file a shard reads
    counts, the
    scales another shard holds too) and each finished shard's own source sha256 (its progress record). Once read,
    the record is replaced by the Hub's current sha256s: the shards kept read the same bytes under both."""

    def __init__(self, source: HubCheckpoint, out: Path, shards: list[ShardJob]):
        self.now = dict(source.lfs_sha256)
        scratch = out / SOURCE_DIR
        before = read_record(scratch / HUB_RECORD)
        before = before.get("sha256") if isinstance(before, dict) else None
        self.changed = {f for f, sha in (before or {}).items() if self.now.get(f) != sha}
        self.use, self.index = SourceUse.of(shards), {s.file: i for i, s in enumerate(shards)}
        (scratch / HUB_RECORD).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(scratch / HUB_RECORD, json.dumps({"commit": source.commit, "sha256": self.now}, indent=1,
                                                      sort_keys=True), tmp_dir=(scratch / HUB_RECORD).parent)

    def stale(self, shard: ShardJob, result: ShardResult) -> bool:
        own = self.now.get(result.source_file, result.source_sha256) != result.source_sha256
        return own or bool(self.use.needs[self.index[shard.file]] & self.changed)


class LocalChanges:
    """What changed in a local source since an earlier run into OUT finished some shards (a shard edited after a
    kill or after the run, its modification time kept or not): `stale(shard, result)` says a finished shard read a
    source file whose bytes are not the ones it was made from, so it is redone. Every file the finished shards
    read is hashed again (on `workers` threads); what they read then is each finished shard's record of its own
    source file's sha256. A file a finished shard read beside its own (scales held in another shard) counts as
    changed unless a finished shard recorded that file's sha256 and it still matches."""

    def __init__(self, ckpt: Checkpoint, shards: list[ShardJob], finished: dict[str, ShardResult], workers: int):
        self.use, self.index = SourceUse.of(shards), {s.file: i for i, s in enumerate(shards)}
        files = sorted(set().union(*[self.use.needs[self.index[f]] for f in finished]) if finished else set())
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            self.now = dict(zip(files, pool.map(lambda f: sha256_file(ckpt.shard_path(f)), files)))
        self.then = {r.source_file: r.source_sha256 for r in finished.values()}

    def stale(self, shard: ShardJob, result: ShardResult) -> bool:
        if self.now.get(result.source_file) != result.source_sha256:
            return True
        return any(self.now.get(f) != self.then.get(f) for f in self.use.needs[self.index[shard.file]])


def streamed_reference(src, stream: bool | None) -> HubRef | None:
    """The Hub repository a run streams from: SRC names one (not a local path) and streaming is not turned off."""
    if stream is False or Path(src).is_dir():
        return None
    return hub_reference(src)


def source_reference(ref: HubRef) -> str:
    """The source as the manifest and the model card record it (the same as a download-first run's)."""
    return f"hf://{ref.repo_id}" + (f"@{ref.revision}" if ref.revision else "")


def local_view(source: HubCheckpoint, root: Path) -> Checkpoint:
    """The Hub checkpoint as its readers see it: the same tensors, its shards under `root`."""
    base = {f.name: getattr(source, f.name) for f in fields(Checkpoint)}
    return Checkpoint(**{**base, "root": root})


def side_file_names(source: HubCheckpoint) -> list[str]:
    """The repository's top-level files an export carries over (what a download-first run fetches and copies:
    quant.planning.source.HUB_PATTERNS, less the weights and the export's own file names)."""
    return sorted(f for f in source.sizes if "/" not in f and not f.startswith(".") and not f.endswith(".safetensors")
                  and f not in OWN_FILES and any(fnmatch.fnmatchcase(f, p) for p in HUB_PATTERNS))


def draft_file_names(source: HubCheckpoint) -> list[str]:
    """The sidecar files (a separate draft) the source's config declares and its repository holds: weights, not
    side files, fetched whole before the shards (a streamed run copies them from what it fetched)."""

    return sidecar_files_present(family_for_config(source.config).name, source.config, source.has_file)


def check_disk(plan: Plan, source: HubCheckpoint, budget: int | None, workers: int, look_ahead: int) -> int:
    """Refuse a budget the run cannot keep to, before any work: the largest set of source files one step of the run
    holds (the shards `workers` read at once and `look_ahead` more, with the files they share), plus the side
    files. Returns that figure."""
    sizes = {f: source.file_size(f) for f in source.sizes}
    need, where = required_disk(plan.shards, sizes, workers + look_ahead)
    need += sum(source.file_size(n) for n in side_file_names(source) + draft_file_names(source))
    if budget is not None and need > budget:
        shard = plan.shards[where]
        raise QuantError(f"--max-disk {_gb(budget)}: too small to stream {source.ref.label}: the run needs "
                         f"{_gb(need)} of source files on disk at once (from {shard.source_file}, {workers} "
                         f"worker(s) and --look-ahead {look_ahead}, with the side files); give at least that, or "
                         f"--look-ahead 0")
    return need


def _gb(n: int) -> str:
    return f"{n / 1e9:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"
