"""How each engine matches `exclude` entries and `layer_quant_config` keys against module names.

- exact_or_regex (SGLang, vLLM `should_ignore_layer`): an entry equals the name, or is "re:" + a regex that
  `re.match`es from the start. Globs and substrings match nothing.
- quark_fnmatch (transformers / Quark runtime): fnmatch, after `QConfig.__post_init__` added `entry + ".*"`.
- layer_quant_config keys: fnmatch (SGLang, Quark); vLLM: `layer_name in key` for keys without "*", else fnmatch.
"""

from __future__ import annotations

import fnmatch
import re
from functools import lru_cache

GLOB_CHARS = re.compile(r"[*?\[]")


class ShardConflict(Exception):
    """Fused shards resolve differently: the engine raises ValueError while building the layer."""

    def __init__(self, decisions: dict[str, object]):
        super().__init__(str(decisions))
        self.decisions = decisions


@lru_cache(maxsize=4096)
def _compile(pattern: str) -> re.Pattern | None:
    try:
        return re.compile(pattern)
    except re.error:
        return None


def is_glob(entry: str) -> bool:
    return not entry.startswith("re:") and bool(GLOB_CHARS.search(entry))


class ExcludeMatcher:
    """Answers "is this name excluded?" the way one engine does; exact names are a set lookup so a
    1,300-entry exclude list over 60k modules stays cheap."""

    def __init__(self, entries: list[str], semantics: str):
        self.entries = list(entries)
        self.semantics = semantics
        self.exact: set[str] = set()
        self.prefixes: set[str] = set()  # quark_fnmatch: "X" also excludes "X.<anything>"
        self.patterns: list[tuple[str, re.Pattern]] = []
        for entry in self.entries:
            if semantics == "exact_or_regex":
                rx = _compile(entry[3:]) if entry.startswith("re:") else None
                if rx is not None:
                    self.patterns.append((entry, rx))
                elif not entry.startswith("re:"):
                    self.exact.add(entry)
            elif semantics == "quark_fnmatch":
                if GLOB_CHARS.search(entry):
                    globs = [entry] if entry.endswith(".*") else [entry, entry + ".*"]
                    for g in globs:
                        self.patterns.append((entry, re.compile(fnmatch.translate(g))))
                else:
                    self.exact.add(entry)
                    self.prefixes.add(entry)
            else:
                raise ValueError(f"unknown exclude semantics {semantics}")
        self._cache: dict[str, bool] = {}

    def matches(self, name: str) -> bool:
        hit = self._cache.get(name)
        if hit is None:
            hit = bool(self.matching_entries(name, first_only=True))
            self._cache[name] = hit
        return hit

    def matching_entries(self, name: str, first_only: bool = False) -> list[str]:
        found: list[str] = []
        if name in self.exact:
            found.append(name)
        if self.prefixes and not (first_only and found):
            parts = name.split(".")
            for i in range(1, len(parts)):
                if ".".join(parts[:i]) in self.prefixes:
                    found.append(".".join(parts[:i]))
        for entry, rx in self.patterns:
            if first_only and found:
                break
            if rx.match(name) and entry not in found:
                found.append(entry)
        return found

    def any_entry_under(self, prefix: str) -> list[str]:
        """vLLM >= PR #46757: entries that literally start with `prefix + "."` (per-expert leaves)."""
        start = prefix + "."
        return [e for e in self.entries if e.startswith(start)]


def ignored(shard_names: list[str], matcher: ExcludeMatcher) -> bool:
    """should_ignore_layer: every shard of a fused module must agree (else ShardConflict)."""
    decisions = {s: matcher.matches(s) for s in shard_names}
    values = set(decisions.values())
    if len(values) > 1:
        raise ShardConflict(decisions)
    return values.pop()


class LayerConfigMatcher:
    def __init__(self, layer_quant_config: dict, semantics: str):
        self.items = list(layer_quant_config.items()) if isinstance(layer_quant_config, dict) else []
        self.semantics = semantics
        self._cache: dict[str, tuple[str, dict] | None] = {}

    def _key_matches(self, name: str, key: str) -> bool:
        if self.semantics == "substring_or_fnmatch" and "*" not in key:
            return name in key
        return fnmatch.fnmatch(name, key)

    def lookup(self, name: str) -> tuple[str, dict] | None:
        if name not in self._cache:
            self._cache[name] = next(((k, v) for k, v in self.items if self._key_matches(name, k)), None)
        return self._cache[name]
