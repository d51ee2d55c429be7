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
import shutil
from pathlib import Path

from quant.checkpoint import INDEX_FILE
from quant.errors import EngineFailure
from quant.ownership import Claim, claim, real_path, remove_path, same_job
from quant.files import write_atomic
from quant.pipeline.model_card import CARD_FILE
from quant.pipeline.shard_records import PROGRESS_DIR

COMPLETE_MARKER = ".quant-complete"
STAGING_DIR = ".quant-staging"
TMP_DIR = ".quant-tmp"
GPTQ_DIR = ".quant-gptq"  # GPTQ's solved weights per decoder layer (quant.gptq.run), until the run is published
SOURCE_DIR = ".quant-source"  # a Hub source streamed shard by shard (quant.pipeline.fetch), until the run is published
MANIFEST_FILE = "quant_manifest.json"
RECIPE_FILE = "quant_recipe.yaml"  # a user's recipe, copied beside the model card that names it
# The final files, in publishing order: config.json last, so its presence means the rest is in place. A new
# final file (written with `Output.stage`) goes here, before config.json.
FINAL_FILES = (INDEX_FILE, MANIFEST_FILE, RECIPE_FILE, CARD_FILE, "config.json")
OWN_FILES = set(FINAL_FILES) | {COMPLETE_MARKER}
SCRATCH_DIRS = (PROGRESS_DIR, STAGING_DIR, TMP_DIR, GPTQ_DIR, SOURCE_DIR)


def read_record(path: Path):
    """A JSON record of ours, or None when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def side_files(src: Path) -> list[str]:
    """The source's files an export carries over (tokenizer, generation config, ...): not weights, not a file
    of the export's own, not hidden."""
    return [f.name for f in sorted(Path(src).iterdir())
            if f.is_file() and f.suffix != ".safetensors" and f.name not in OWN_FILES and not f.name.startswith(".")]


def verified_shards(hold: Claim) -> dict[str, tuple[int, str]]:
    """Shards a killed run of ours finished: named by a progress record in our own `.quant-progress/` (trusted
    only in a directory whose owner record is valid) and still holding the bytes that record hashed."""
    progress = hold.root / PROGRESS_DIR
    if hold.previous is None or not hold.is_scratch(PROGRESS_DIR):
        return {}
    found = {}
    for record in sorted(progress.glob("*.json")):
        data = read_record(record)
        result = data.get("result") if isinstance(data, dict) else None
        if not isinstance(result, dict):
            continue
        name, size, digest = result.get("file"), result.get("bytes"), result.get("sha256")
        if name == record.name[: -len(".json")] and "/" not in str(name) and isinstance(size, int) \
                and isinstance(digest, str) and hold.digest(name) == (size, digest):
            found[name] = (size, digest)
    return found


class Output:
    """One run's hold on OUT: `with Output(out, identity, source, overwrite, names) as o:` applies the ownership
    rule (`quant.ownership`: a new or empty directory, or an earlier quantize of the same source and settings,
    which resumes; anything else needs --overwrite, and even then a file of someone else's where the run would
    write is refused before any work) and takes the lock (a second run stops with a message), `begin()` clears
    what an earlier run of ours left unfinished, `tmp(name)` is where a file is written before it is renamed into
    place, `stage(name, data)` writes a final file, `publish(marker)` moves them in."""

    def __init__(self, out: Path, identity: dict | None = None, source: Path | None = None,
                 overwrite: bool = False, names: list[str] | None = None):
        self.claim = claim(Path(out), "quantize", identity=identity, inputs={"source checkpoint": source},
                           overwrite=overwrite)
        self.root = real_path(out)
        self.names = list(names or []) + list(FINAL_FILES) + [COMPLETE_MARKER] + list(SCRATCH_DIRS)
        self.staged: list[str] = []
        self.hold = None

    def check(self) -> None:
        """The ownership rule alone, before any work."""
        self.claim.check()

    def __enter__(self) -> "Output":
        self.hold = self.claim.__enter__()
        try:
            shards = verified_shards(self.hold)
            if shards:
                self.hold.add(sorted(shards), hashes=shards)
            self.hold.require_free(self.names)
            previous = self.hold.previous
            if previous is not None and (previous.kind != "quantize" or not same_job(previous, self.hold.identity)):
                self.hold.remove_all_ours()  # only reachable with --overwrite (the claim refuses otherwise)
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
                if path.is_dir() and not path.is_symlink() and not any(p for p in path.rglob("*") if p.is_file()):
                    shutil.rmtree(path)
        self.claim.__exit__(*exc)

    def sha256(self, path: Path) -> str | None:
        """sha256 of a file of OUT (a regular file, no symlink on the way), read once while the run holds OUT."""
        found = self.hold.digest(Path(path).name)
        return found[1] if found else None

    def own(self, names, hashes: dict[str, tuple[int, str]] | None = None) -> None:
        """Record files this run wrote, with their size and sha256 (from `hashes` where already known)."""
        self.hold.add(list(names), hashes)

    def place(self, name: str, written: Path) -> None:
        """Move `written` (a finished file in OUT's scratch directory) to `name`, recorded as ours first."""
        self.hold.adopt(name, written)

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
        stale = sorted(p.name for p in self.tmp_dir.iterdir()) if self.hold.is_scratch(TMP_DIR) else []
        for name in ("config.json", COMPLETE_MARKER) + FINAL_FILES[:-1]:
            self.hold.remove_ours(name)  # ours by the record (a file of someone else's was refused on entry)
        for name in (TMP_DIR, STAGING_DIR):
            if self.hold.is_scratch(name):
                remove_path(self.root / name)
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
        self.own(names[:-1] + [COMPLETE_MARKER])
        os.replace(self.staging_dir / "config.json", self.root / "config.json")
        self.own(["config.json"])
        self.staging_dir.rmdir()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        if self.hold.is_scratch(SOURCE_DIR):  # what is left of a streamed source: side files, download records
            remove_path(self.root / SOURCE_DIR)
