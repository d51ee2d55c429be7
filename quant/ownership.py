"""Which directories a command may write into: one rule for every command that writes (`toy`, `quantize`,
`eval --out`, `eval --card`, `demo`).

A directory is ours to write into when it is new or empty, or when its owner record (`.quant-owner.json`, written
by the command that made it) says it is the output of the same command for the same job (quantize: the same
source and settings, so the run resumes). Anything else is refused with one line naming the directory and
`--overwrite`. With `--overwrite` we write our files into it, but still delete only what our own records say we
wrote. Some paths are refused outright, flag or not: the filesystem root, the home directory, the working
directory or a directory above it, a command's input, and a directory that contains one of its inputs.

One run at a time writes into a directory (`.quant-lock`, an flock held for the whole command), and a run that
fails in a directory it created, before writing anything but its own bookkeeping, removes that directory again.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from quant.errors import QuantError

OWNER_FILE = ".quant-owner.json"
LOCK_FILE = ".quant-lock"
TOOL = "moe-quant"


def _resolved(path: Path) -> Path:
    return Path(os.path.abspath(Path(path).expanduser()))


def refuse_protected(out: Path, inputs: dict[str, Path | None] | None = None, *, what: str = "output") -> None:
    """Refuse, whatever the flags, an output that is the root, the home directory, the working directory (or
    above it), an input of the command, inside an input, or a directory holding an input."""
    o = _resolved(out)
    cwd = _resolved(Path.cwd())
    if o == Path(o.anchor):
        raise QuantError(f"{out}: refusing to use the filesystem root as the {what} directory")
    if o == _resolved(Path.home()):
        raise QuantError(f"{out}: refusing to use the home directory as the {what} directory; name a new one")
    if o == cwd or o in cwd.parents:
        raise QuantError(f"{out}: refusing to use the working directory (or a directory above it) as the {what} "
                         f"directory; name a new subdirectory")
    for label, path in (inputs or {}).items():
        if path is None:
            continue
        p = _resolved(path)
        if o == p or p in o.parents:
            raise QuantError(f"{out}: the {what} directory must not be the {label} ({path}) or inside it")
        if o in p.parents:
            raise QuantError(f"{out}: the {what} directory contains the {label} ({path}); choose another "
                             f"directory")


def remove_path(path: Path) -> None:
    """Delete a file, link or directory tree if it is there (callers decide that it is ours)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def read_owner(out: Path) -> dict | None:
    try:
        record = json.loads((Path(out) / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("tool") == TOOL else None


def _only_bookkeeping(out: Path) -> bool:
    return all(p.name in (OWNER_FILE, LOCK_FILE) for p in out.iterdir())


def same_job(previous: dict | None, identity: dict | None) -> bool:
    """Equal identities; a key the earlier record does not know (None) does not count against it."""
    before = (previous or {}).get("identity") or {}
    now = identity or {}
    return all(before.get(k) is None or before.get(k) == v for k, v in now.items())


@dataclass
class Claim:
    """A command's hold on its output directory (see the module docstring). `previous` is the earlier owner
    record of the same kind (its `written` list names what we may delete), None when there is none."""

    root: Path
    kind: str
    identity: dict | None
    previous: dict | None
    created: bool
    written: list[str] = field(default_factory=list)
    _lock = None

    def _acquire(self) -> None:
        import fcntl

        self._lock = open(self.root / LOCK_FILE, "a")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            self._lock = None
            raise QuantError(f"{self.root}: another quant command is writing into this directory; wait for it to "
                             f"finish (or stop it) and run again") from None

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def save(self, written: list[str] | None = None) -> None:
        """Write the owner record; `written` (top-level names, relative to the directory) adds to what we own."""
        for name in written or []:
            if name not in self.written:
                self.written.append(name)
        record = {"tool": TOOL, "kind": self.kind, "identity": self.identity, "written": self.written}
        tmp = self.root / (OWNER_FILE + ".tmp")
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
        os.replace(tmp, self.root / OWNER_FILE)

    def written_before(self) -> list[str]:
        return list((self.previous or {}).get("written") or [])

    def remove_ours(self, name: str) -> None:
        """Delete `name` (a file or directory inside the claim) if our records say we wrote it."""
        if name not in self.written_before() and name not in self.written:
            raise AssertionError(f"{name} is not ours to delete")
        remove_path(self.root / name)

    def replace_with(self, staging: Path) -> None:
        """Move every entry of `staging` (a directory of ours beside the claim) into the claim, replacing
        entries of the same name, and delete what the earlier output of ours had that the new one lacks."""
        names = sorted(p.name for p in Path(staging).iterdir())
        for name in self.written_before():
            if name not in names and (self.root / name).exists():
                self.remove_ours(name)
        for name in names:
            target = self.root / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(Path(staging) / name, target)
        Path(staging).rmdir()
        self.save(names)


class claim:
    """`with claim(out, "eval", inputs={...}, overwrite=flag) as c:` checks the rule, creates the directory,
    takes the lock and writes the owner record; on a failure in a directory it created that holds nothing but
    bookkeeping, removes it.

    `recognise(out)`: for outputs written before owner records existed, an owner-like record
    ({"identity": ...}) when `out` is one of this kind, else None."""

    def __init__(self, out: Path, kind: str, *, identity: dict | None = None,
                 inputs: dict[str, Path | None] | None = None, overwrite: bool = False,
                 recognise: Callable[[Path], dict | None] | None = None, flag: str = "--overwrite",
                 what: str = "output"):
        self.out, self.kind, self.identity = Path(out), kind, identity
        self.inputs, self.overwrite, self.recognise, self.flag, self.what = inputs, overwrite, recognise, flag, what
        self.c: Claim | None = None

    def check(self) -> Claim:
        """The rule, without writing anything."""
        out = self.out
        refuse_protected(out, self.inputs, what=self.what)
        if out.exists() and not out.is_dir():
            raise QuantError(f"{out}: exists and is not a directory")
        if not out.exists():
            return Claim(out, self.kind, self.identity, None, created=True)
        if _only_bookkeeping(out) or not any(out.iterdir()):
            return Claim(out, self.kind, self.identity, read_owner(out), created=False)
        previous = read_owner(out)
        if previous is None and self.recognise is not None:
            legacy = self.recognise(out)
            previous = {"tool": TOOL, "kind": self.kind, **legacy} if legacy is not None else None
        if previous is not None and previous.get("kind") == self.kind:
            if same_job(previous, self.identity):
                return Claim(out, self.kind, self.identity, previous, created=False)
            if self.overwrite:
                return Claim(out, self.kind, self.identity, previous, created=False)
            raise QuantError(f"{out}: holds a {self.kind} output of another job ({_differs(previous, self.identity)}); "
                             f"choose a new directory, or pass {self.flag} to replace it (only files this tool "
                             f"wrote there are removed)")
        if self.overwrite:
            return Claim(out, self.kind, self.identity, None, created=False)
        owner = f"a quant {previous['kind']} output" if previous else "not an output of this tool"
        raise QuantError(f"{out}: directory is not empty and is {owner}; choose a new or empty directory, or pass "
                         f"{self.flag} to write into it anyway (nothing this tool did not write is deleted)")

    def __enter__(self) -> Claim:
        c = self.check()
        c.root.mkdir(parents=True, exist_ok=True)
        c._acquire()
        try:
            again = self.check()  # another run may have written between the check and the lock
            c.previous = again.previous
            c.written = list(again.written_before()) if same_job(again.previous, self.identity) else []
            c.save()
        except BaseException:
            c._release()
            raise
        self.c = c
        return c

    def __exit__(self, exc_type, exc, tb) -> bool:
        c = self.c
        c._release()
        if exc_type is not None and c.created and c.root.is_dir() and _only_bookkeeping(c.root):
            shutil.rmtree(c.root, ignore_errors=True)
        return False


def _differs(previous: dict, identity: dict | None) -> str:
    before = previous.get("identity") or {}
    keys = [k for k, v in (identity or {}).items() if before.get(k) is not None and before.get(k) != v]
    named = [f"{k} {before[k]!r}, not {identity[k]!r}" for k in keys if not k.endswith("digest")]
    return "; ".join(named) if named else "other settings"
