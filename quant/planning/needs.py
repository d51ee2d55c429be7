"""Which source files each output shard needs, and the least disk a run that fetches them on demand can work in.

An output shard needs its own source shard and every other shard one of its jobs reads: a block-FP8 weight's
`weight_scale_inv` or a microscaled weight's `.scale` stored in another shard (any `*file` field of a job's
Source). A source file is needed from the first shard that reads it to the last one; it may go once that last
shard is written. `live(i)` (the files whose span covers shard i) is what must be on disk while shard i is made,
and a run of `span` shards at once (workers, plus the look-ahead) needs the union of `span` consecutive lives.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from quant.planning.plan import ShardJob


def job_files(source) -> set[str]:
    """The files a job's Source reads: every non-empty `*file` field (the tensor's, its scales')."""
    return {getattr(source, f.name) for f in fields(source) if f.name.endswith("file") and getattr(source, f.name)}


def shard_needs(shard: ShardJob) -> set[str]:
    files = {shard.source_file}
    for job in shard.jobs:
        files |= job_files(job.source)
    return files


@dataclass
class SourceUse:
    """Over the shards still to make (in order): each one's needed files, and each file's first and last user."""

    needs: list[set[str]]
    first: dict[str, int]
    last: dict[str, int]

    @classmethod
    def of(cls, shards: list[ShardJob]) -> "SourceUse":
        needs = [shard_needs(s) for s in shards]
        first: dict[str, int] = {}
        last: dict[str, int] = {}
        for i, files in enumerate(needs):
            for f in files:
                first.setdefault(f, i)
                last[f] = i
        return cls(needs, first, last)

    def order(self) -> list[str]:
        """The files in the order they are first needed (then by name)."""
        return sorted(self.first, key=lambda f: (self.first[f], f))

    def live(self, start: int, span: int = 1) -> set[str]:
        """The files needed by some shard in [start, start + span) or held across it (first before, last after)."""
        end = start + span - 1
        return {f for f in self.first if self.first[f] <= end and self.last[f] >= start}


def required_disk(shards: list[ShardJob], sizes: dict[str, int], span: int) -> tuple[int, int]:
    """(the most bytes of source files on disk at once when `span` consecutive shards are in hand, the first
    shard index where that happens). 0 bytes for no shards."""
    use = SourceUse.of(shards)
    worst, where = 0, 0
    for i in range(len(shards)):
        total = sum(sizes.get(f, 0) for f in use.live(i, span))
        if total > worst:
            worst, where = total, i
    return worst, where
