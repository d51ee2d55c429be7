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
from quant.errors import EngineFailure, QuantError
from quant.ownership import LOCK_FILE, OWNER_FILE, claim, remove_path, same_job
from quant.pipeline.files import write_atomic
from quant.pipeline.model_card import CARD_FILE
from quant.pipeline.progress import PROGRESS_DIR

COMPLETE_MARKER = ".quant-complete"
STAGING_DIR = ".quant-staging"
TMP_DIR = ".quant-tmp"
GPTQ_DIR = ".quant-gptq"  # GPTQ's solved weights per decoder layer (quant.gptq.run), until the run is published
MANIFEST_FILE = "quant_manifest.json"
RECIPE_FILE = "quant_recipe.yaml"  # a user's recipe, copied beside the model card that names it
# The final files, in publishing order: config.json last, so its presence means the rest is in place. A new
# final file (written with `Output.stage`) goes here, before config.json.
FINAL_FILES = (INDEX_FILE, MANIFEST_FILE, RECIPE_FILE, CARD_FILE, "config.json")
OWN_FILES = set(FINAL_FILES) | {COMPLETE_MARKER}
LEGACY_TMP = re.compile(r"^\.tmp[A-Za-z0-9_]{6,8}$")
BOOKKEEPING = {PROGRESS_DIR, STAGING_DIR, TMP_DIR, GPTQ_DIR, LOCK_FILE, OWNER_FILE}


def read_record(path: Path):
    """A JSON record of ours, or None when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _is_progress_record(record: Path, out: Path) -> bool:
    """A progress record of ours: our keys, naming the shard it is named after, which is there beside it."""
    data = read_record(record)
    if not isinstance(data, dict) or not isinstance(data.get("plan_digest"), str):
        return False
    shard = record.name[: -len(".json")]
    result = data.get("result")
    return isinstance(result, dict) and result.get("file") == shard and (out / shard).is_file()


def earlier_quantize(out: Path) -> dict | None:
    """An earlier (or running) quantize's output written before owner records existed, known by its records: a
    completion marker of ours, a progress record that matches a shard beside it, or nothing but our own
    bookkeeping (a run killed before its first shard). A foreign directory with an empty or made-up
    `.quant-progress/` is not. Returns an owner-like record ({"identity": {"plan_digest": ...}}) or None."""
    marker = read_record(out / COMPLETE_MARKER)
    if isinstance(marker, dict) and isinstance(marker.get("plan_digest"), str):
        return {"identity": {"plan_digest": marker["plan_digest"]}}
    progress = out / PROGRESS_DIR
    records = [r for r in progress.glob("*.json") if _is_progress_record(r, out)] if progress.is_dir() else []
    if records:
        return {"identity": {"plan_digest": read_record(records[0])["plan_digest"]}}
    if all(p.name in BOOKKEEPING for p in out.iterdir()):
        return {"identity": {}}
    return None


def files_of_earlier_run(out: Path) -> set[str]:
    """Top-level names an earlier quantize wrote into OUT, by its own records: the shards of its progress records
    and index, its final files, the side files its manifest lists as copied, and its bookkeeping."""
    names = set(FINAL_FILES) | {COMPLETE_MARKER} | (BOOKKEEPING - {LOCK_FILE, OWNER_FILE})
    progress = out / PROGRESS_DIR
    for record in progress.glob("*.json") if progress.is_dir() else []:
        data = read_record(record)
        if isinstance(data, dict) and isinstance(data.get("result"), dict):
            names.add(str(data["result"].get("file")))
    index = read_record(out / INDEX_FILE)
    if isinstance(index, dict) and isinstance(index.get("weight_map"), dict):
        names |= {str(f) for f in index["weight_map"].values()}
    manifest = read_record(out / MANIFEST_FILE)
    if isinstance(manifest, dict):
        names |= {str(f) for f in (manifest.get("output") or {}).get("copied_files") or []}
        names |= {str(f) for f in (manifest.get("output") or {}).get("shards") or {}}
    return {n for n in names if n and "/" not in n and n not in (".", "..")}


class Output:
    """One run's hold on OUT: `with Output(out, identity, source, overwrite) as o:` applies the ownership rule
    (`quant.ownership`: a new or empty directory, or an earlier quantize of the same source and settings, which
    resumes; anything else needs --overwrite) and takes the lock (a second run stops with a message), `begin()`
    clears what an earlier run left unfinished, `tmp(name)` is where a file is written before it is renamed into
    place, `stage(name, data)` writes a final file, `publish(marker)` moves them in."""

    def __init__(self, out: Path, identity: dict | None = None, source: Path | None = None,
                 overwrite: bool = False):
        self.root = Path(out)
        self.claim = claim(self.root, "quantize", identity=identity, inputs={"source checkpoint": source},
                           overwrite=overwrite, recognise=earlier_quantize)
        self.staged: list[str] = []
        self.hold = None

    def check(self) -> None:
        """The ownership rule alone, before any work."""
        self.claim.check()

    def __enter__(self) -> "Output":
        self.hold = self.claim.__enter__()
        try:
            if self.hold.previous is not None and not same_job(self.hold.previous, self.hold.identity):
                self._remove_earlier_run()  # only reachable with --overwrite (the claim refuses otherwise)
        except BaseException as e:
            self.claim.__exit__(type(e), e, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:  # a failed run leaves its finished shards (resumable), never half-made temporaries
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            if not isinstance(exc[1], EngineFailure):  # a failed self-check leaves its config to inspect (--fix)
                shutil.rmtree(self.staging_dir, ignore_errors=True)
            for name in (GPTQ_DIR, PROGRESS_DIR):  # bookkeeping that holds no finished work goes too
                path = self.root / name
                if path.is_dir() and not any(p for p in path.rglob("*") if p.is_file()):
                    shutil.rmtree(path)
        self.claim.__exit__(*exc)

    def _remove_earlier_run(self) -> None:
        """--overwrite over an earlier quantize of other settings: its files go (ours, by its records); nothing
        else in OUT is touched."""
        for name in sorted(files_of_earlier_run(self.root) | set(self.hold.written_before())):
            if name not in (LOCK_FILE, OWNER_FILE):
                remove_path(self.root / name)
        self.hold.written = []
        self.hold.save()

    def own(self, names) -> None:
        """Record top-level names this run wrote (the owner record's `written`)."""
        self.hold.save(list(names))

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
