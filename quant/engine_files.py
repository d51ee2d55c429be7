"""The engine rules on disk: one folder per engine under manifests/engines/, listed in its index.yaml.

    manifests/engines/index.yaml              the engines, in the order every question about all engines asks them
    manifests/engines/<engine>/engine.yaml    title, default_releases, serving and the engine-wide rules
    manifests/engines/<engine>/<release>.yaml one release: the rules that differ, optionally `inherits: <release>`

A release file's name is its version; releases are ordered by it (oldest first, packaging's version order), so
adding a release is adding its file (and naming it in default_releases when it should be checked by default). Its
rules are the engine-wide ones with its overrides merged in (engine_rules.merge), or, with `inherits`, the named
release's merged rules with its overrides merged in. Every file is checked against the schema (engine_rules.py)
when the folder is read: a problem is one QuantError naming the file and the key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from quant.engine_rules import EngineRules, RuleReader, check_overrides, merge, typed_rules
from quant.errors import QuantError

INDEX = "index.yaml"
ENGINE_FILE = "engine.yaml"
# engine.yaml's keys besides its rules: its title, the releases `--engine NAME` checks, and whether a preflight
# naming no engine checks it (`serving`).
ENGINE_KEYS = ("title", "default_releases", "serving")
# A release file's key besides its rules: the release whose merged rules it starts from (default: engine-wide).
INHERITS = "inherits"
_RULE_KEYS = tuple(f.name for f in dataclasses.fields(EngineRules))


@dataclass(frozen=True)
class ReleaseFile:
    name: str
    path: Path
    inherits: str | None
    overrides: dict[str, Any]


@dataclass(frozen=True)
class EngineFiles:
    """One engine's folder, read and checked."""

    name: str
    path: Path
    title: str
    default_releases: tuple[str, ...]
    serving: bool
    engine_wide: dict[str, Any]
    releases: dict[str, ReleaseFile]  # oldest first

    def merged(self, release: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
        """The release's rules as raw YAML: its overrides merged into what it starts from."""
        entry = self.releases[release]
        if entry.inherits is None:
            return merge(self.engine_wide, entry.overrides)
        if release in seen:
            raise QuantError(f"{entry.path}: {INHERITS}: a cycle ({' -> '.join((*seen, release))})")
        return merge(self.merged(entry.inherits, (*seen, release)), entry.overrides)

    def rules(self, release: str) -> EngineRules:
        return typed_rules(self.merged(release), self.releases[release].path)


def read_engines(root: Path) -> dict[str, EngineFiles]:
    """Every engine under `root` (a manifests/engines folder), in index.yaml's order, each file checked and each
    release's merged rules typed once (so a bad file fails here, not at the first question asked of it)."""
    index = _mapping(root / INDEX)
    for key in index:
        if key != "engines":
            raise QuantError(f"{root / INDEX}: {key}: unknown key (known: engines)")
    names = index.get("engines")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise QuantError(f"{root / INDEX}: engines: expected a list of engine folder names")
    folders = {p.name for p in root.iterdir() if p.is_dir()}
    for stray in sorted(folders - set(names)):
        raise QuantError(f"{root / stray}: an engine folder not listed in {root / INDEX}")
    engines = {name: _read_engine(root / name) for name in names}
    for engine in engines.values():
        for release in engine.releases:
            engine.rules(release)
    return engines


def _read_engine(folder: Path) -> EngineFiles:
    path = folder / ENGINE_FILE
    raw = _mapping(path)
    for key in raw:
        if key not in (*ENGINE_KEYS, *_RULE_KEYS):
            raise RuleReader(path).unknown("", key, (*ENGINE_KEYS, *_RULE_KEYS))
    title = raw.get("title", folder.name)
    if not isinstance(title, str):
        raise QuantError(f"{path}: title: expected a string")
    serving = raw.get("serving", False)
    if not isinstance(serving, bool):
        raise QuantError(f"{path}: serving: expected true or false")
    wide = {k: v for k, v in raw.items() if k not in ENGINE_KEYS}
    check_overrides(wide, path)
    releases = _read_releases(folder)
    if not releases:
        raise QuantError(f"{folder}: no release file (<release>.yaml beside {ENGINE_FILE})")
    defaults = raw.get("default_releases") or []
    if not isinstance(defaults, list) or any(str(r) not in releases for r in defaults):
        raise QuantError(f"{path}: default_releases: expected a list of releases among {', '.join(releases)}")
    return EngineFiles(folder.name, path, title, tuple(str(r) for r in defaults), serving, wide, releases)


def _read_releases(folder: Path) -> dict[str, ReleaseFile]:
    from packaging.version import InvalidVersion, Version

    found = []
    for path in folder.glob("*.yaml"):
        if path.name == ENGINE_FILE:
            continue
        try:
            found.append((Version(path.stem), _read_release(path)))
        except InvalidVersion:
            raise QuantError(f"{path}: a release file is named by its version (0.5.23.yaml)") from None
    releases = {r.name: r for _, r in sorted(found, key=lambda item: item[0])}
    for r in releases.values():
        if r.inherits is not None and r.inherits not in releases:
            raise QuantError(f"{r.path}: {INHERITS}: no release '{r.inherits}' (releases: {', '.join(releases)})")
    return releases


def _read_release(path: Path) -> ReleaseFile:
    raw = _mapping(path, empty_ok=True)
    for key in raw:
        if key not in (INHERITS, *_RULE_KEYS):
            raise RuleReader(path).unknown("", key, (INHERITS, *_RULE_KEYS))
    inherits = raw.get(INHERITS)
    if inherits is not None and not isinstance(inherits, str):
        raise QuantError(f"{path}: {INHERITS}: expected a release, quoted (\"0.5.23\")")
    overrides = {k: v for k, v in raw.items() if k != INHERITS}
    check_overrides(overrides, path)
    return ReleaseFile(path.stem, path, inherits, overrides)


def _mapping(path: Path, empty_ok: bool = False) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise QuantError(f"{path}: cannot read engine rules ({first})") from None
    if data is None and empty_ok:
        return {}
    if not isinstance(data, dict):
        raise QuantError(f"{path}: expected a mapping, got {type(data).__name__}")
    return data
