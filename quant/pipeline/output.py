"""The output directory's lifecycle: which directory may be written, one run at a time, temporaries, staging
and publishing.

While a run is under way, or after one was killed, OUT holds finished shards (each written under `.quant-tmp/`
and renamed into place whole), `.quant-progress/` (one record per finished shard: what makes a run resumable),
`.quant-tmp/` (every temporary, safetensors' own `.tmpXXXXXX` included), `.quant-staging/` (the final files
waiting for the self-check) and `.quant-lock`. A finished OUT has the final files beside the shards and
`.quant-complete`, and no `.quant-tmp/` or `.quant-staging/`.

The invariant: a `config.json` in OUT means every shard, the index, the manifest and the model card are there and
the self-check passed. Final files are staged and moved into place only after the self-check, config.json last
(the marker just before it), and a re-run removes the earlier run's final files before it writes anything. So
after any kill or failure OUT is either complete or visibly incomplete (no config.json), and a re-run resumes it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from quant.checkpoint import INDEX_FILE
from quant.errors import QuantError
from quant.pipeline.files import OutputLock, write_atomic
from quant.pipeline.model_card import CARD_FILE
from quant.pipeline.progress import PROGRESS_DIR

COMPLETE_MARKER = ".quant-complete"
STAGING_DIR = ".quant-staging"
TMP_DIR = ".quant-tmp"
GPTQ_DIR = ".quant-gptq"  # GPTQ's solved weights per decoder layer (quant.gptq.run), until the run is published
MANIFEST_FILE = "quant_manifest.json"
# The final files, in publishing order: config.json last, so its presence means the rest is in place. A new
# final file (written with `Output.stage`) goes here, before config.json.
FINAL_FILES = (INDEX_FILE, MANIFEST_FILE, CARD_FILE, "config.json")
OWN_FILES = set(FINAL_FILES) | {COMPLETE_MARKER}
LEGACY_TMP = re.compile(r"^\.tmp[A-Za-z0-9_]{6,8}$")
BOOKKEEPING = {PROGRESS_DIR, STAGING_DIR, TMP_DIR, GPTQ_DIR, OutputLock.NAME}


def check_paths(src: Path, out: Path) -> None:
    s, o = src.resolve(), out.resolve()
    if o == s or s in o.parents:
        raise QuantError(f"{out}: the output must not be the source checkpoint or inside it ({src})")
    if o in s.parents:
        raise QuantError(f"{out}: the output must not contain the source checkpoint ({src})")
    if o.exists() and not o.is_dir():
        raise QuantError(f"{out}: exists and is not a directory")
    if o.is_dir() and any(o.iterdir()) and not is_earlier_output(o):
        raise QuantError(f"{out}: directory is not empty and is not an earlier quant output; "
                         f"choose an empty or new directory")


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _is_progress_record(record: Path, out: Path) -> bool:
    """A progress record of ours: our keys, naming the shard it is named after, which is there beside it."""
    data = _read_json(record)
    if not isinstance(data, dict) or not isinstance(data.get("plan_digest"), str):
        return False
    shard = record.name[: -len(".json")]
    result = data.get("result")
    return isinstance(result, dict) and result.get("file") == shard and (out / shard).is_file()


def is_earlier_output(out: Path) -> bool:
    """An earlier (or running) quantize's output, known by its records: a completion marker of ours, a progress
    record that matches a shard beside it, or nothing but our own bookkeeping (a run killed before its first
    shard). A foreign directory with an empty or made-up `.quant-progress/` is not."""
    marker = _read_json(out / COMPLETE_MARKER)
    if isinstance(marker, dict) and isinstance(marker.get("plan_digest"), str):
        return True
    progress = out / PROGRESS_DIR
    if progress.is_dir() and any(_is_progress_record(r, out) for r in progress.glob("*.json")):
        return True
    return all(p.name in BOOKKEEPING for p in out.iterdir())


class Output:
    """One run's hold on OUT: `with Output(out) as o:` takes the lock (a second run stops with a message),
    `begin()` clears what an earlier run left unfinished, `tmp(name)` is where a file is written before it is
    renamed into place, `stage(name, data)` writes a final file, `publish(marker)` moves them in."""

    def __init__(self, out: Path):
        self.root = Path(out)
        self.lock = OutputLock(self.root)
        self.staged: list[str] = []

    def __enter__(self) -> "Output":
        self.root.mkdir(parents=True, exist_ok=True)
        self.lock.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.lock.__exit__(*exc)

    @property
    def tmp_dir(self) -> Path:
        return self.root / TMP_DIR

    @property
    def staging_dir(self) -> Path:
        return self.root / STAGING_DIR

    def begin(self) -> list[str]:
        """Make OUT visibly unfinished and clear what an interrupted run left: every temporary (all live in our
        own `.quant-tmp/`, so nothing else is touched), the staged files, and the earlier run's final files
        (config.json first). Returns the names of the temporaries removed. Runs under the lock, so no live run
        owns them."""
        stale = sorted(p.name for p in self.tmp_dir.iterdir()) if self.tmp_dir.is_dir() else []
        # Earlier versions wrote temporaries beside the shards: `<name>.tmp` and safetensors' `.tmpXXXXXX`.
        for p in self.root.iterdir():
            if p.is_file() and (p.name.endswith(".tmp") or LEGACY_TMP.match(p.name)):
                p.unlink()
                stale.append(p.name)
        for name in ("config.json", COMPLETE_MARKER) + FINAL_FILES[:-1]:
            (self.root / name).unlink(missing_ok=True)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        shutil.rmtree(self.staging_dir, ignore_errors=True)
        for d in (self.tmp_dir, self.root / PROGRESS_DIR):
            d.mkdir(exist_ok=True)
        return stale

    def tmp(self, name: str) -> Path:
        return self.tmp_dir / name

    def write(self, path: Path, data: bytes | str) -> None:
        """Write `path` atomically, its temporary in `.quant-tmp/`."""
        write_atomic(path, data, tmp_dir=self.tmp_dir)

    def stage(self, name: str, data: bytes | str) -> Path:
        """Write final file `name` (one of FINAL_FILES) into the staging directory."""
        assert name in FINAL_FILES, name
        self.staging_dir.mkdir(exist_ok=True)
        self.write(self.staging_dir / name, data)
        if name not in self.staged:
            self.staged.append(name)
        return self.staging_dir / name

    def publish(self, marker: str) -> None:
        """Move the staged files beside the shards in FINAL_FILES order with config.json last, the completion
        marker just before it: at every instant OUT either lacks config.json or is complete."""
        names = [n for n in FINAL_FILES if n in self.staged]
        assert names[-1:] == ["config.json"], names
        for name in names[:-1]:
            os.replace(self.staging_dir / name, self.root / name)
        self.write(self.root / COMPLETE_MARKER, marker)
        os.replace(self.staging_dir / "config.json", self.root / "config.json")
        self.staging_dir.rmdir()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
