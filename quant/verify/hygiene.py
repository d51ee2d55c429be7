"""Checks on the exclude list itself, the MTP layers and checkpoint integrity (exclude matching: vLLM / SGLang
quark/utils.py should_ignore_layer, exact or `re:` + re.match; MTP tensors: vLLM deepseek_mtp.py)."""

from __future__ import annotations

import bisect
import fnmatch
import re

from quant import engines
from quant.checkpoint import Checkpoint
from quant.families import text_config
from quant.engines import Profile
from quant.verify.matching import GLOB_CHARS, is_glob
from quant.verify.report import Finding

EXCLUDE_KEY = "config.json:quantization_config.exclude"
_UNESCAPED_DOT = re.compile(r"(?<!\\)\.(?![*+?{])")
_LAYER_LITERAL = re.compile(r"layers\\?\.(\d+)")


def integrity_findings(ckpt: Checkpoint) -> list[Finding]:
    return [Finding("error", "all", (), p.tensor or p.file, p.message,
                    "re-export or repair the checkpoint so the index and the shard headers agree",
                    f"integrity: {p.kind}") for p in ckpt.problems]


def glob_to_regex(entry: str) -> str:
    """A `re:` entry matching what Quark's fnmatch matches for `entry` (including its implicit `entry + ".*"`),
    written with plain regex syntax any engine's Python understands (no atomic groups)."""
    out = []
    for ch in entry:
        out.append(".*" if ch == "*" else "." if ch == "?" else ch if ch in "[]" else re.escape(ch))
    body = "".join(out)
    return f"re:{body}$" if entry.endswith(".*") else f"re:{body}(?:\\..*)?$"


class NameIndex:
    """Every module name any engine looks up (checkpoint, runtime, fused and coarse names); exact entries
    also count when they name an ancestor (`model.layers.3` for a draft class's whole-layer check)."""

    def __init__(self, names: set[str]):
        self.names = names
        self._sorted: list[str] | None = None
        self._all: set[str] | None = None

    def has(self, entry: str) -> bool:
        if entry in self.names:
            return True
        if self._sorted is None:
            self._sorted = sorted(self.names)
        i = bisect.bisect_left(self._sorted, entry + ".")
        return i < len(self._sorted) and self._sorted[i].startswith(entry + ".")

    def with_ancestors(self) -> set[str]:
        if self._all is None:
            self._all = set(self.names)
            for name in self.names:
                parts = name.split(".")
                self._all.update(".".join(parts[:i]) for i in range(1, len(parts)))
        return self._all


def lookup_names(modules, config: dict) -> set[str]:
    """Every name some engine (selected or not) looks up: checkpoint module names, the NextN draft's MTP runtime
    names, fused names of every engine's packed mapping and coarse FusedMoE prefixes."""
    names = set(modules)
    mtp = engines.mtp_layers(config)
    fused_of: dict[str, set[str]] = {}
    for profile in engines.all_profiles():
        for fused, shards in profile.rules.packed_modules_mapping.items():
            for shard in shards:
                fused_of.setdefault(shard, set()).add(fused)
    for name, mod in modules.items():
        if mod.layer is not None and mod.layer in mtp:
            names.update(engines.exclude_aliases(name, config))
        names.update(engines.wrapper_aliases(name, config))
        names.update(engines.namespace_aliases(name, config))
    for name in list(names):
        parent, _, leaf = name.rpartition(".")
        for fused in fused_of.get(leaf, ()):
            names.add(f"{parent}.{fused}")
        if ".experts." in name:
            names.add(name[: name.index(".experts.") + len(".experts")])
    for name in list(names):
        if name.startswith("model.decoder."):
            parent, _, leaf = name.rpartition(".")
            names.update(f"{parent}.{f}" for f in fused_of.get(leaf, ()))
    return names


def exclude_findings(exclude: list[str], names: set[str], profiles: list[Profile]) -> list[Finding]:
    """Pattern hygiene, engine by engine."""
    index = NameIndex(names)
    out: list[Finding] = []
    by_engine: dict[str, list[Profile]] = {}
    for p in profiles:
        by_engine.setdefault(p.engine, []).append(p)
    glob_engines = ", ".join(dict.fromkeys(p.engine for p in engines.all_profiles()
                                           if p.rules.exclude_match == "quark_fnmatch"))
    for entry in exclude:
        for engine, ps in by_engine.items():
            semantics = ps[0].rules.exclude_match
            versions = tuple(p.release for p in ps)
            if semantics == "exact_or_regex" and is_glob(entry):
                out.append(Finding("warning", engine, versions, EXCLUDE_KEY,
                                   f"exclude entry {entry!r} is a glob: {ps[0].title} matches exact names or "
                                   "re: patterns only, so it excludes nothing",
                                   f"replace it with {glob_to_regex(entry)!r} (keep the glob for {glob_engines})",
                                   "exclude glob"))
            if semantics == "exact_or_regex" and entry.startswith("re:"):
                try:
                    re.compile(entry[3:])
                except re.error as e:
                    out.append(Finding("error", engine, versions, EXCLUDE_KEY,
                                       f"exclude entry {entry!r} is not a valid regex: {ps[0].title} raises "
                                       f"re.error ({e})", "fix the pattern", "pattern hygiene"))
            if semantics == "quark_fnmatch" and entry.startswith("re:"):
                out.append(Finding("warning", engine, versions, EXCLUDE_KEY,
                                   f"exclude entry {entry!r}: Quark matches exclude entries with fnmatch, so a "
                                   f"re: pattern excludes nothing in {engine}",
                                   f"also list the module names (or an fnmatch glob) for {engine}",
                                   "exclude glob"))
        out.extend(_pattern_warnings(entry, index))
    return out


def _entry_matches(entry: str, index: NameIndex) -> list[str]:
    if entry.startswith("re:") or GLOB_CHARS.search(entry):
        try:
            rx = re.compile(entry[3:] if entry.startswith("re:") else fnmatch.translate(entry))
        except re.error:
            return []
        return [n for n in index.with_ancestors() if rx.match(n)]
    return [entry] if index.has(entry) else []


def _pattern_warnings(entry: str, index: NameIndex) -> list[Finding]:
    out = []
    hits = _entry_matches(entry, index)
    if not hits:
        inside = [] if entry.startswith("re:") or GLOB_CHARS.search(entry) else \
            [n for n in index.names if entry in n][:2]
        if inside:
            message = (f"exclude entry {entry!r} matches no module exactly; engines do not match substrings "
                       f"(it occurs inside e.g. {inside[0]})")
            fix = f"list the full names, or write 're:.*{re.escape(entry)}$'"
        else:
            message = f"exclude entry {entry!r} matches no module of this checkpoint under any engine's names"
            fix = "remove it or correct the name (typo?)"
        out.append(Finding("warning", "all", (), EXCLUDE_KEY, message, fix, "pattern hygiene"))
        return out
    if entry.startswith("re:"):
        body = entry[3:]
        if _UNESCAPED_DOT.search(body):
            escaped = _UNESCAPED_DOT.sub(lambda m: "\\.", body)
            out.append(Finding("warning", "all", (), EXCLUDE_KEY,
                               f"exclude entry {entry!r} has an unescaped '.', which matches any character",
                               f"escape literal dots: 're:{escaped}'", "pattern hygiene"))
        literal = _LAYER_LITERAL.findall(body)
        if literal:
            wanted = set(literal)
            matched = {m.group(1) for n in hits for m in [re.search(r"layers\.(\d+)", n)] if m}
            others = sorted((i for i in matched - wanted if any(i.startswith(w) for w in wanted)), key=int)
            if others:
                out.append(Finding("warning", "all", (), EXCLUDE_KEY,
                                   f"exclude entry {entry!r} is a layer-number prefix: it also matches layer(s) "
                                   f"{', '.join(others[:5])} (e.g. model.layers.{literal[0]} vs "
                                   f"model.layers.{others[0]})",
                                   f"anchor the number: 're:{body}' + an escaped dot (or end it with '$')",
                                   "pattern hygiene"))
    return out


def fused_regex_findings(exclude: list[str], profile: Profile, fused_units) -> list[Finding]:
    """`re:.*v_proj` also matches `...qkv_proj`: a regex hitting a fused name without hitting all its shards."""
    out = []
    for entry in exclude:
        if not entry.startswith("re:"):
            continue
        try:
            rx = re.compile(entry[3:])
        except re.error:
            continue
        for unit in fused_units:
            if rx.match(unit.runtime) and not all(rx.match(s) for s in unit.shard_runtime):
                out.append(Finding("warning", profile.engine, (profile.release,), EXCLUDE_KEY,
                                   f"exclude entry {entry!r} also matches the fused module {unit.runtime} (re.match "
                                   "is not end-anchored); releases that honour fused names directly exclude all "
                                   "of its shards", f"end the pattern with '$' (e.g. 're:{entry[3:]}$')",
                                   "pattern hygiene"))
                break
    return out


def _missing_mtp_layers(ckpt: Checkpoint, p: Profile, present: set) -> list[tuple[int, str]]:
    """(the engine's index, the checkpoint tensors it looks for) of each declared MTP layer the draft of profile `p`
    finds nothing of: model.layers.{N+k}.*, or the namespace its loader reads (engine rules mtp_namespace
    layer_prefix: DeepSeek-V4's mtp.{k}.*)."""
    layers = p.namespace_layers(ckpt.config)
    if layers:
        return [(idx, prefix + "*") for idx, prefix in layers
                if not any(t.startswith(prefix) for t in ckpt.tensors)]
    return [(idx, f"model.layers.{idx}.*") for idx in engines.mtp_layers(ckpt.config) if idx not in present]


def mtp_findings(ckpt: Checkpoint, profiles: list[Profile]) -> list[Finding]:
    config = ckpt.config
    out: list[Finding] = []
    mtp = engines.mtp_layers(config)
    key = engines.mtp_count_key(config)
    n = int(text_config(config).get("num_hidden_layers") or 0)
    present = {engines.layer_index(t) for t in ckpt.tensors} - {None}
    for p in profiles:
        rule = p.rules.mtp
        if not rule.builds_mtp:
            continue
        for idx, tensors in _missing_mtp_layers(ckpt, p, present):
            if rule.missing_layer_error:
                msg = f"{p.title} raises {rule.missing_layer_error.format(index=idx)}"
                severity = "error"
            else:
                msg = (f"{key} declares MTP layer {idx} but no {tensors} tensor "
                       f"exists: {p.title} builds the draft with nothing to load (inferred)")
                severity = "warning"
            out.append(Finding(severity, p.engine, (p.release,), tensors, msg,
                               f"export the MTP layer (it stays BF16), or set {key} to 0",
                               "mtp layer missing"))
        if rule.max_layers and len(mtp) > rule.max_layers:
            out.append(Finding("error", p.engine, (p.release,), f"config.json:{key}",
                               f"{p.title} asserts num_nextn_layers == {rule.max_layers} "
                               "(\"Only 1 nextn layer is supported\")", "serve with one MTP layer",
                               "mtp layer missing"))
    extra = sorted(i for i in present if i >= n + len(mtp))
    if n and extra:
        out.append(Finding("warning", "all", (), f"model.layers.{extra[0]}.*",
                           f"tensors for layer(s) {', '.join(map(str, extra[:5]))} lie beyond num_hidden_layers "
                           f"({n}) + {key} ({len(mtp)}): engines ignore them, or build them "
                           "with the wrong scheme when MTP is enabled", f"declare the MTP layer in {key}, or drop "
                           "the tensors", "mtp layer missing"))
    return out


def shared_expert_fusion_findings(config: dict, profiles: list[Profile]) -> list[Finding]:
    """Engines with `shared_expert_fusion_veto` (engine rules): an excluded shared expert (any layer, MTP included)
    vetoes shared-expert fusion for the whole model (performance only)."""
    q = config.get("quantization_config") or {}
    exclude = q.get("exclude") if isinstance(q.get("exclude"), list) else []
    if int(text_config(config).get("n_shared_experts") or 0) != 1:
        return []
    vetoes = [e for e in exclude if "shared_expert" in str(e) and "shared_expert_gate" not in str(e)
              and not str(e).startswith("mtp.")]
    if not vetoes:
        return []
    by_engine: dict[str, list[Profile]] = {}
    for p in profiles:
        if p.rules.shared_expert_fusion_veto:
            by_engine.setdefault(p.engine, []).append(p)
    return [Finding("warning", engine, tuple(p.release for p in ps), EXCLUDE_KEY,
                    f"exclude lists shared experts ({vetoes[0]}{' ...' if len(vetoes) > 1 else ''}): {ps[0].title} "
                    "disables shared-expert fusion for every layer (slower decode, no load failure)",
                    "accept it, or quantize the shared experts like the routed ones", "shared-expert fusion")
            for engine, ps in by_engine.items()]
