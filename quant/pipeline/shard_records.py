"""Per-shard progress records, which make a run resumable.

Each finished output shard gets a record (`.quant-progress/<shard>.json`) holding the plan digest, the output's
sha256 and the per-tensor records. A re-run skips a shard whose record matches the plan and whose bytes still
hash to the record, so a killed run resumes to the same bytes as an uninterrupted one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from quant.files import sha256_file
from quant.planning.plan import ShardJob

PROGRESS_DIR = ".quant-progress"


@dataclass
class ShardResult:
    file: str
    sha256: str
    bytes: int
    source_file: str
    source_sha256: str
    tensors: dict  # output tensor name -> {dtype, shape}
    records: dict  # job output -> record


def progress_path(out: Path, shard: ShardJob) -> Path:
    return out / PROGRESS_DIR / (shard.file + ".json")


def completed(out: Path, shard: ShardJob, digest: str, hash_file=sha256_file) -> ShardResult | None:
    """The recorded result of a shard finished by an earlier run of the same plan, if its bytes still match
    (`hash_file(path)`: the shard's sha256; the output's claim passes its own, which reads each file once)."""
    rec_path, shard_path = progress_path(out, shard), out / shard.file
    if not (rec_path.is_file() and shard_path.is_file()):
        return None
    try:
        rec = json.loads(rec_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if rec.get("plan_digest") != digest or shard_path.stat().st_size != rec["result"]["bytes"]:
        return None
    if hash_file(shard_path) != rec["result"]["sha256"]:
        return None
    return ShardResult(**rec["result"])
