"""Which directories a command may write into, and which files in them it may delete: one rule for every command
that writes (`toy`, `quantize`, `eval --out`, `eval --card`, `demo`).

Paths are judged by what they are, not how they are spelled: every comparison (the root, the home directory, the
working directory, an input, an output inside an input or holding one) is made on the resolved path (symlinks and
`..` followed) and, for directories that exist, on their device and inode too (bind mounts).

A directory is ours to write into when it is new or empty, or when its owner record (`.quant-owner.json`) says it
is the output of the same command for the same job (quantize: the same source and settings, so the run resumes).
Anything else is refused with one line naming the directory and `--overwrite`. With `--overwrite` we write our
files into it, but never where a file we did not write already stands (refused before any work, one line), and
we delete only files our record names whose bytes still match it.

The owner record is checked, not trusted: every name in it must be relative, normalised and inside the directory
(no `..`, no absolute path), every file recorded with its size and sha256, and a file is deleted only while it is
still a regular file (not a symlink, under no symlinked directory) with that size and hash. A record that fails
the check makes the directory "not ours" (exit 2, one line). Scratch space lives in tool-owned subdirectories
with names no user would pick (`SCRATCH`), removed whole only in a directory whose record is valid.

One run at a time writes into a directory (`.quant-lock`, an flock held for the whole command), and a run that
fails before writing anything but its own bookkeeping leaves the directory as it found it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from quant.errors import QuantError
from quant.files import sha256_file, write_atomic

OWNER_FILE = ".quant-owner.json"
LOCK_FILE = ".quant-lock"
TOOL = "moe-quant"
RECORD_VERSION = 2
# Tool-owned scratch directories: names no user would pick, removed whole (never followed through a symlink).
SCRATCH = re.compile(r"^\.quant-(tmp|staging|progress|gptq|source|eval|toy-[0-9a-f]{8})$")
BOOKKEEPING = (OWNER_FILE, LOCK_FILE)


# --- paths as they really are -----------------------------------------------------------------------------------

def real_path(path: Path | str) -> Path:
    """The path with `~`, `..` and every symlink resolved (for a path that does not exist yet: its existing part)."""
    return Path(os.path.realpath(os.path.expanduser(os.fspath(path))))


def _file_id(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def is_within(inner: Path | str, outer: Path | str) -> bool:
    """`inner` is `outer` or below it, judged on resolved paths and, where `outer` exists, on the device and inode
    of `inner`'s existing ancestors (a bind mount of `outer` elsewhere is still `outer`)."""
    ri, ro = real_path(inner), real_path(outer)
    if ri == ro or ro in ri.parents:
        return True
    outer_id = _file_id(ro)
    return outer_id is not None and any(_file_id(a) == outer_id for a in (ri, *ri.parents))


def require_usable_name(path: Path | str, what: str) -> None:
    """A path we will print, record and hand to other libraries must be valid UTF-8 and must not be a symlink
    to nothing (dangling) or to itself (a loop)."""
    text = os.fspath(path)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        shown = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        raise QuantError(f"{shown}: the {what} name is not valid UTF-8; rename it") from None
    if os.path.islink(text):
        try:
            os.stat(text)
        except OSError as e:
            why = "a loop of symbolic links" if e.errno == errno.ELOOP else "a symbolic link to nothing"
            raise QuantError(f"{text}: the {what} is {why}; give a directory or a new path") from None


def check_new_file(path: Path, flag: str, inputs: dict[str, Path | None], overwrite: bool) -> None:
    """A single file a command writes on request (`verify-manifest --fix`, `eval --write-gate`): a usable name,
    never inside one of the command's inputs (judged on resolved paths, so a symlink or `..` does not get around
    it), never a directory or a symlink (a link is never written through or replaced), and never over an existing
    file without --overwrite."""
    path = Path(path)
    require_usable_name(path, flag)
    require_usable_name(path.parent, f"{flag} directory")
    for label, source in inputs.items():
        if source is not None and (is_within(real_path(path.parent) / path.name, source) or is_within(path, source)):
            raise QuantError(f"{flag} {path}: inside the {label} {source}; this command never writes into what it "
                             f"reads: write elsewhere")
    if path.is_symlink():
        raise QuantError(f"{flag} {path}: is a symbolic link; give the plain path of the file to write (a link is "
                         f"never written through or replaced)")
    if path.is_dir():
        raise QuantError(f"{flag} {path}: is a directory; give the path of the file to write")
    if os.path.lexists(path) and not overwrite:
        raise QuantError(f"{flag} {path}: exists; choose a new path or pass --overwrite to replace it")


def refuse_protected(out: Path, inputs: dict[str, Path | None] | None = None, *, what: str = "output") -> None:
    """Refuse, whatever the flags, an output that is (once resolved) the root, the home directory, the working
    directory (or above it), an input of the command, inside an input, or a directory holding an input."""
    require_usable_name(out, f"{what} directory")
    o = real_path(out)
    if o == Path(o.anchor):
        raise QuantError(f"{out}: refusing to use the filesystem root as the {what} directory")
    if is_within(Path.home(), o):
        raise QuantError(f"{out}: refusing to use the home directory (or a directory holding it) as the {what} "
                         f"directory; name a new one")
    if is_within(Path.cwd(), o):
        raise QuantError(f"{out}: refusing to use the working directory (or a directory above it) as the {what} "
                         f"directory; name a new subdirectory")
    for label, path in (inputs or {}).items():
        if path is None:
            continue
        if is_within(o, path):
            raise QuantError(f"{out}: the {what} directory must not be the {label} ({path}) or inside it")
        if is_within(path, o):
            raise QuantError(f"{out}: the {what} directory contains the {label} ({path}); choose another "
                             f"directory")


# --- the owner record -------------------------------------------------------------------------------------------

def valid_name(name) -> bool:
    """A name the record may hold: relative, normalised, inside the directory."""
    if not isinstance(name, str) or not name or name.startswith("/") or "\0" in name or "\\" in name:
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


@dataclass
class Record:
    """A checked owner record: what one command wrote into a directory, each file with its size and sha256."""

    kind: str
    identity: dict | None
    files: dict[str, tuple[int, str]] = field(default_factory=dict)
    dirs: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps({"tool": TOOL, "version": RECORD_VERSION, "kind": self.kind, "identity": self.identity,
                           "files": {k: list(v) for k, v in sorted(self.files.items())},
                           "dirs": sorted(self.dirs)}, indent=1, sort_keys=True)


class NotOurs(QuantError):
    """An owner record that fails the check."""


def parse_record(data, where: Path) -> Record:
    """The checked record in `data` (the parsed JSON of `where`); NotOurs when it is not a record of this tool's
    current format that passes the check (another tool's file, an older version's unverifiable record, a forged
    one)."""
    if not isinstance(data, dict) or data.get("tool") != TOOL or data.get("version") != RECORD_VERSION:
        raise NotOurs(f"{where}: not an owner record this version of the tool wrote (its files cannot be verified); "
                      f"this directory is not ours: move the record away or choose another directory")
    bad = f"{where}: an owner record that fails its check"
    kind, files, dirs = data.get("kind"), data.get("files"), data.get("dirs")
    if not isinstance(kind, str) or not isinstance(files, dict) or not isinstance(dirs, list):
        raise NotOurs(f"{bad} (malformed); this directory is not ours: move the record away or choose another "
                      f"directory")
    identity = data.get("identity")
    if identity is not None and not isinstance(identity, dict):
        raise NotOurs(f"{bad} (identity); this directory is not ours")
    checked: dict[str, tuple[int, str]] = {}
    for name, entry in files.items():
        ok = valid_name(name) and isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int) \
            and entry[0] >= 0 and isinstance(entry[1], str) and re.fullmatch(r"[0-9a-f]{64}", entry[1])
        if not ok:
            raise NotOurs(f"{bad} (file entry {name!r}); this directory is not ours: move the record away or "
                          f"choose another directory")
        checked[name] = (entry[0], entry[1])
    for name in dirs:
        if not valid_name(name):
            raise NotOurs(f"{bad} (directory entry {name!r}); this directory is not ours: move the record away or "
                          f"choose another directory")
    return Record(kind, identity, checked, list(dirs))


def read_record(out: Path) -> Record | None:
    """The directory's checked owner record; None when there is none; NotOurs when one is there and fails."""
    path = Path(out) / OWNER_FILE
    if os.path.islink(path):
        raise NotOurs(f"{path}: the owner record is a symbolic link; this directory is not ours")
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        raise NotOurs(f"{path}: an unreadable owner record; this directory is not ours: move it away or choose "
                      f"another directory") from None
    return parse_record(data, path)


def same_job(previous: Record | None, identity: dict | None) -> bool:
    """Equal identities; a key the earlier record does not know (None) does not count against it."""
    before = (previous.identity if previous else None) or {}
    return all(before.get(k) is None or before.get(k) == v for k, v in (identity or {}).items())


def _real_dirs_to(root: Path, name: str) -> bool:
    """Every directory between `root` and `root/name` is a real directory (no symlink on the way)."""
    parent = root
    for part in name.split("/")[:-1]:
        parent = parent / part
        try:
            if not stat.S_ISDIR(os.lstat(parent).st_mode):
                return False
        except OSError:
            return False
    return True


def regular_file(root: Path, name: str) -> os.stat_result | None:
    """The stat of `root/name` when it is a regular file reached through real directories only, else None."""
    if not _real_dirs_to(root, name):
        return None
    try:
        st = os.lstat(root / name)
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def unchanged(root: Path, name: str, entry: tuple[int, str]) -> bool:
    """`root/name` is still the regular file we recorded: no symlink on the way, the same size and sha256."""
    st = regular_file(root, name)
    return st is not None and st.st_size == entry[0] and sha256_file(root / name) == entry[1]


def remove_path(path: Path) -> None:
    """Delete a file, a link (never what it points to) or a directory tree (scratch of ours only)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


# --- a command's hold on its output directory -------------------------------------------------------------------

@dataclass
class Claim:
    """A command's hold on its output directory (see the module docstring). `previous` is the directory's checked
    owner record before this command (its files are ours to delete while they match), None when there is none."""

    root: Path
    kind: str
    identity: dict | None
    previous: Record | None
    created: bool
    overwrite: bool = False
    record: Record | None = None
    _lock = None
    _before: set = field(default_factory=set)
    # sha256 of files read while the claim is held, by name, with the stat they were read at: a resumed run asks
    # for a finished shard's hash three times (its progress record, the ownership check, the resume check).
    _digests: dict = field(default_factory=dict)

    @property
    def trusted(self) -> bool:
        """The directory's contents can be ours: it is new, or it has a valid record of ours."""
        return self.created or self.previous is not None

    def _acquire(self) -> None:
        # Never through a symlink: a lock file is ours to create, never someone else's file to open.
        try:
            fd = os.open(self.root / LOCK_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o666)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise QuantError(f"{self.root / LOCK_FILE}: a symbolic link where this tool keeps its lock; this "
                             f"directory is not ours: move it away or choose another directory") from None
        self._lock = os.fdopen(fd, "a")
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

    def save(self) -> None:
        write_atomic(self.root / OWNER_FILE, self.record.to_json(), tmp_dir=self.root)

    def digest(self, name: str) -> tuple[int, str] | None:
        """(size, sha256) of `root/name` when it is a regular file reached through real directories, else None;
        each file is read once while the claim is held (unless it changes)."""
        st = regular_file(self.root, name)
        if st is None:
            return None
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._digests.get(name)
        if cached is None or cached[0] != key:
            cached = (key, sha256_file(self.root / name))
            self._digests[name] = cached
        return st.st_size, cached[1]

    def ours(self, name: str) -> bool:
        """`name` (relative to the directory) is a file we wrote and it still holds what we wrote."""
        entry = self.record.files.get(name)
        return entry is not None and self.digest(name) == tuple(entry)

    def is_scratch(self, name: str) -> bool:
        path = self.root / name
        return bool(SCRATCH.match(name)) and self.trusted and path.is_dir() and not path.is_symlink()

    def foreign(self, names) -> list[str]:
        """Of the top-level `names` a command is about to write, what already stands there and is not ours:
        files not recorded or changed since, symlinks, anything in a directory that is not a file of ours."""
        found = []
        for name in names:
            path = self.root / name
            if not os.path.lexists(path) or self.is_scratch(name):
                continue
            if path.is_dir() and not path.is_symlink():
                for parent, dirs, files in os.walk(path):
                    rel = Path(parent).relative_to(self.root).as_posix()
                    for entry in sorted(files) + [d for d in sorted(dirs) if os.path.islink(os.path.join(parent, d))]:
                        if not self.ours(f"{rel}/{entry}"):
                            found.append(f"{rel}/{entry}")
            elif not self.ours(name):
                found.append(name)
        return found

    def require_free(self, names) -> None:
        """Refuse (one line, exit 2) before any work when a file we did not write stands where we will write."""
        found = self.foreign(names)
        if found:
            more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
            raise QuantError(f"{self.root / found[0]}: exists and was not written by this tool (or was changed since)"
                             f"{more}; nothing is overwritten, even with --overwrite: move it away or choose another "
                             f"directory")

    def add(self, names, hashes: dict[str, tuple[int, str]] | None = None) -> None:
        """Record files we wrote (relative names; a directory adds every file under it), with their size and
        sha256 (taken from `hashes` where the caller already has them), and save the record."""
        for name in names:
            path = self.root / name
            if path.is_dir() and not path.is_symlink():
                self._add_dir(name)
                for parent, dirs, files in os.walk(path):
                    rel = Path(parent).relative_to(self.root).as_posix()
                    for d in dirs:
                        self._add_dir(f"{rel}/{d}")
                    for f in files:
                        self._add_file(f"{rel}/{f}", (hashes or {}).get(f"{rel}/{f}"))
            elif path.is_file() and not path.is_symlink():
                self._add_file(name, (hashes or {}).get(name))
        self.save()

    def adopt(self, name: str, written: Path) -> None:
        """Rename the finished file `written` (in a scratch directory of ours) to `name`, recorded as ours before the
        rename: a run stopped between the two leaves either no file there or one that is ours, never one it would
        later call foreign. Its bytes are read once (the record's sha256 is the digest's too: a rename keeps the
        inode and mtime)."""
        st = os.stat(written)
        digest = sha256_file(written)
        self._add_file(name, (st.st_size, digest))
        self.save()
        os.replace(written, self.root / name)
        self._digests[name] = ((st.st_ino, st.st_size, st.st_mtime_ns), digest)

    def add_dirs(self, names) -> None:
        """Record directories this command makes (each holds outputs of their own, with their own records)."""
        for name in names:
            self._add_dir(name)
        self.save()

    def _add_dir(self, name: str) -> None:
        if name not in self.record.dirs:
            self.record.dirs.append(name)

    def _add_file(self, name: str, known: tuple[int, str] | None) -> None:
        assert valid_name(name), name
        for i in range(1, name.count("/") + 1):
            self._add_dir("/".join(name.split("/")[:i]))
        self.record.files[name] = known or self.digest(name)

    def remove_ours(self, name: str) -> list[str]:
        """Delete what we wrote at `name` (a file, or a directory's files of ours and then its directories of ours
        left empty); a file that is not ours, or changed since, stays. Returns what stayed."""
        if self.is_scratch(name):
            remove_path(self.root / name)
            return []
        kept = []
        inside = [f for f in self.record.files if f == name or f.startswith(name + "/")]
        for f in inside:
            if self.ours(f):
                (self.root / f).unlink()
            elif os.path.lexists(self.root / f):
                kept.append(f)
            del self.record.files[f]
        for d in sorted((d for d in self.record.dirs if d == name or d.startswith(name + "/")),
                        key=lambda d: -d.count("/")):
            path = self.root / d
            if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
                path.rmdir()
            self.record.dirs.remove(d)
        self.save()
        return kept

    def remove_all_ours(self, keep: Path | None = None) -> list[str]:
        """Delete every file the record names (that still matches) and our scratch but `keep`: an earlier output
        of ours. Returns what stayed (changed since we wrote it)."""
        kept = []
        for top in sorted({n.split("/")[0] for n in list(self.record.files) + self.record.dirs}):
            kept += self.remove_ours(top)
        for entry in sorted(os.listdir(self.root)):
            if self.is_scratch(entry) and self.root / entry != keep:
                remove_path(self.root / entry)
        return kept

    def replace_with(self, staging: Path) -> None:
        """Move every entry of `staging` (a scratch directory of ours inside the claim) into the claim: what our
        earlier output had goes first (ours only), a name a file of someone else's holds is refused before any
        move (one line), and the new files are recorded."""
        names = sorted(p.name for p in Path(staging).iterdir())
        self.require_free(names)
        self.remove_all_ours(keep=Path(staging))
        for name in names:
            os.replace(Path(staging) / name, self.root / name)
        Path(staging).rmdir()
        self.add(names)


class claim:
    """`with claim(out, "eval", inputs={...}, overwrite=flag) as c:` checks the rule, creates the directory,
    takes the lock and writes the owner record; a run that fails having written nothing but bookkeeping leaves
    the directory as it found it (removed when it created it)."""

    def __init__(self, out: Path, kind: str, *, identity: dict | None = None,
                 inputs: dict[str, Path | None] | None = None, overwrite: bool = False, flag: str = "--overwrite",
                 what: str = "output"):
        self.out, self.kind, self.identity = Path(out), kind, identity
        self.inputs, self.overwrite, self.flag, self.what = inputs, overwrite, flag, what
        self.c: Claim | None = None

    def check(self) -> Claim:
        """The rule, without writing anything. The claim's root is the resolved directory: every later path
        decision (and every deletion) is made inside it."""
        refuse_protected(self.out, self.inputs, what=self.what)
        out = real_path(self.out)
        if out.exists() and not out.is_dir():
            raise QuantError(f"{self.out}: exists and is not a directory")
        if not out.exists():
            return Claim(out, self.kind, self.identity, None, created=True, overwrite=self.overwrite)
        previous = read_record(out)
        if all(p.name in BOOKKEEPING for p in out.iterdir()):
            return Claim(out, self.kind, self.identity, previous, created=False, overwrite=self.overwrite)
        if previous is not None and previous.kind == self.kind and same_job(previous, self.identity):
            return Claim(out, self.kind, self.identity, previous, created=False, overwrite=self.overwrite)
        if self.overwrite:
            return Claim(out, self.kind, self.identity, previous, created=False, overwrite=True)
        if previous is not None and previous.kind == self.kind:
            raise QuantError(f"{self.out}: holds a {self.kind} output of another job "
                             f"({_differs(previous, self.identity)}); choose a new directory, or pass {self.flag} to "
                             f"replace it (only files this tool wrote there are removed)")
        owner = f"a quant {previous.kind} output" if previous else "not an output of this tool"
        raise QuantError(f"{self.out}: directory is not empty and is {owner}; choose a new or empty directory, or "
                         f"pass {self.flag} to write into it anyway (nothing this tool did not write is deleted or "
                         f"overwritten)")

    def __enter__(self) -> Claim:
        c = self.check()
        c._before = set() if c.created else set(os.listdir(c.root))
        c.root.mkdir(parents=True, exist_ok=True)
        c._acquire()
        try:
            again = self.check()  # another run may have written between the check and the lock
            c.previous = again.previous
            c.record = Record(self.kind, self.identity)
            if c.previous is not None:  # what an earlier output of ours wrote stays ours (to resume or remove)
                c.record.files, c.record.dirs = dict(c.previous.files), list(c.previous.dirs)
            c.save()
        except BaseException:
            c._release()
            raise
        self.c = c
        return c

    def __exit__(self, exc_type, exc, tb) -> bool:
        c = self.c
        c._release()
        if exc_type is None:
            return False
        now = set(os.listdir(c.root)) if c.root.is_dir() else set()
        if now - set(BOOKKEEPING) == c._before - set(BOOKKEEPING):  # it wrote nothing but its bookkeeping
            if c.created:
                shutil.rmtree(c.root, ignore_errors=True)
            elif c.previous is None:  # a directory that was not ours is left as it was found
                for name in BOOKKEEPING:
                    if name not in c._before:
                        (c.root / name).unlink(missing_ok=True)
        return False


@contextlib.contextmanager
def held(root: Path):
    """Hold the directory's lock while reading an output of ours (`quant push`): no command writes into it
    meanwhile (a second one stops with a message). A directory no one may write to (read-only, no permission) is
    read without one."""
    c = Claim(real_path(root), "", None, None, created=False)
    try:
        c._acquire()
    except OSError as e:
        if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
    try:
        yield
    finally:
        c._release()


def update_record(root: Path, names: list[str], *, kind: str) -> None:
    """Record files a later command rewrote in an output of ours (`eval --card` in an export), under its lock."""
    c = Claim(real_path(root), kind, None, read_record(root), created=False)
    if c.previous is None or c.previous.kind != kind:
        raise QuantError(f"{root}: not a {kind} output of this tool")
    c._acquire()
    try:
        c.record = read_record(c.root)
        c.add(names)
    finally:
        c._release()



def _differs(previous: Record, identity: dict | None) -> str:
    before = previous.identity or {}
    keys = [k for k, v in (identity or {}).items() if before.get(k) is not None and before.get(k) != v]
    named = [f"{k} {before[k]!r}, not {identity[k]!r}" for k in keys if not k.endswith("digest")]
    return "; ".join(named) if named else "other settings"
