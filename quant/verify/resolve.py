"""Resolve every module the way one engine release does, and compare with what is stored on disk.

For each profile the checkpoint is split into build contexts: the target model and, where the engine builds
one, the MTP/NextN draft (with that engine's names and its own view of `exclude` / `layer_quant_config`).
Each unit is resolved to excluded / a scheme exactly as the engine's `get_quant_method` would, then its
tensors are checked against that scheme's contract.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

from quant.families import text_config
from quant import engines
from quant.engine_rules import MtpNamespace
from quant.engines import Profile, Renamer
from quant.verify import contract
from quant.verify.matching import ExcludeMatcher, LayerConfigMatcher, ShardConflict, ignored
from quant.verify.modules import Module, Unit, build_units
from quant.verify.report import Finding
from quant.verify.schema import classify


@dataclass
class BuildContext:
    label: str  # "target" | "draft"
    units: list[Unit]
    exclude: ExcludeMatcher
    layer_config: LayerConfigMatcher
    never_quantized: re.Pattern | None
    quantized: bool = True
    unquantized_reason: str = ""
    exclude_note: str = ""
    # fused modules matched against exclude / layer_quant_config by the fused name, not per shard
    whole_fused: frozenset = frozenset()


@dataclass
class Resolution:
    kind: str | None  # scheme kind; None = built unquantized
    reason: str = ""  # why unquantized / where the config came from
    entries: list[str] = field(default_factory=list)  # exclude entries that matched
    layer_cfg: dict | None = None


def _q(config: dict) -> dict:
    return config.get("quantization_config") or {}


def _exclude_list(config: dict) -> list[str]:
    ex = _q(config).get("exclude")
    return [str(e) for e in ex] if isinstance(ex, list) else []


def _lqc(config: dict) -> dict:
    lqc = _q(config).get("layer_quant_config")
    return lqc if isinstance(lqc, dict) else {}


def build_contexts(profile: Profile, config: dict, modules: dict[str, Module],
                   cache: dict | None = None) -> list[BuildContext]:
    """Target (and draft) contexts of one profile; `cache` shares identical unit lists between releases."""
    cache = {} if cache is None else cache
    rules = profile.rules
    packed = rules.packed_modules_mapping
    group_experts = True  # per-leaf engines split the groups again while resolving (_leaf_groups)
    never = _any_of(profile.never_quantized(config))
    mtp_range = engines.mtp_layers(config)
    n_layers = int(text_config(config).get("num_hidden_layers") or 0)
    namespace = engines.mtp_namespace_prefix(config)
    main = {k: m for k, m in modules.items() if (m.layer is None or m.layer < n_layers)
            and not (namespace and k.startswith(namespace))}
    exclude, lqc = _exclude_list(config), _lqc(config)
    whole = profile.unexpanded_fused(config)
    # Wrapped architectures (VL models): units carry the engine's runtime names; `exclude` is rewritten with the
    # same mapper only by releases whose quant config applies it. Build prefixes (engine rules build_prefixes)
    # rename units too but never `exclude`.
    contexts = [BuildContext(
        "target", _identity_units(main, packed, group_experts, False, cache, profile.renamer(config)),
        ExcludeMatcher(profile.quant_config_exclude(exclude, config), rules.exclude_match),
        LayerConfigMatcher(profile.quant_config_layer_config(lqc, config), rules.layer_config_match),
        never, whole_fused=whole)]
    if not rules.mtp.builds_mtp:
        return contexts
    rule = profile.mtp_namespace(config)
    if rule is not None:
        contexts.append(_namespace_draft(profile, rule, exclude, lqc, modules, packed, config))
        contexts[-1].whole_fused = whole
        return contexts
    if not len(mtp_range):
        return contexts
    mtp_modules = {k: m for k, m in modules.items() if m.layer in mtp_range}
    if rules.mtp.draft_naming == "nextn":
        contexts.append(_nextn_draft(profile, config, mtp_modules, packed))
    else:
        # The draft shares the target's quant config (its exclude and layer_quant_config rewritten with the target's
        # mapper) and builds the MTP layers under the checkpoint's names or its own (mtp.draft_names).
        contexts.append(BuildContext(
            "draft", _identity_units(mtp_modules, packed, group_experts, True, cache, profile.draft_renamer(config)),
            contexts[0].exclude, contexts[0].layer_config,
            _any_of(rules.never_quantized + rules.mtp.never_quantized)))
    contexts[-1].whole_fused = whole  # the draft class inherits the target's packed mapping (engine rules)
    return contexts


def _namespace_draft(profile: Profile, rule: MtpNamespace, exclude: list[str], lqc: dict,
                     modules: dict[str, Module], packed: dict, config: dict) -> BuildContext:
    """The draft of a namespaced MTP head: `exclude` is matched as written against the names the draft builds its
    modules under (mtp_namespace draft_names: vLLM's DeepSeek-V4 draft builds mtp.0.* as model.layers.{N}.*), or,
    where the draft rewrites `exclude` with the same renames (maps_exclude), against the checkpoint's names; some
    engines build the whole head unquantized once any entry names it."""
    prefix = rule.prefix
    mtp_modules = {k: m for k, m in modules.items() if k.startswith(prefix)}
    built = (lambda n: n) if rule.maps_exclude else (lambda n: profile.namespace_draft_name(n, config))
    units = build_units(mtp_modules, built, packed, True, lambda _: True)
    never = _any_of(profile.rules.never_quantized + rule.never_quantized)
    quantized, reason = True, ""
    hits = [e for e in exclude if e.startswith(prefix)]
    if rule.any_exclude_unquantizes and hits:
        quantized = False
        reason = (f"exclude lists {hits[0]!r}{' and more' if len(hits) > 1 else ''}, so {profile.title} builds "
                  f"the whole {prefix}* draft unquantized")
    return BuildContext("draft", units, ExcludeMatcher(exclude, profile.rules.exclude_match),
                        LayerConfigMatcher(lqc, profile.rules.layer_config_match), never, quantized, reason,
                        f"{prefix}* draft")


def _any_of(patterns: list[str]) -> re.Pattern | None:
    return re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns else None


def _identity_units(modules: dict[str, Module], packed: dict, group_experts: bool, mtp: bool,
                    cache: dict, renamer: Renamer = Renamer()) -> list[Unit]:
    """Units under checkpoint names (or the engine's mapped names: `renamer`); engines sharing a packed mapping
    share them (a 120k-tensor checkpoint is grouped once per engine, not once per release)."""
    key = (tuple(sorted((k, tuple(v)) for k, v in packed.items())), group_experts, mtp, renamer)
    if key not in cache:
        cache[key] = build_units(modules, renamer.name, packed, group_experts, lambda n: mtp)
    return cache[key]


def _nextn_draft(profile: Profile, config: dict, mtp_modules: dict[str, Module], packed: dict) -> BuildContext:
    """The draft of an engine that builds the first MTP layer under NextN runtime names (mtp.draft_naming: nextn),
    reading `exclude` / `layer_quant_config` the way its draft class does (mtp.draft_classes)."""
    cls_name, cls = profile.draft_class(config)
    mapper = profile.draft_exclude_mapper(config)
    prefix = f"model.layers.{engines.mtp_layers(config).start}"
    units = build_units(mtp_modules, lambda name: profile.mtp_draft_name(name, config), packed, True, lambda _: True)
    entries = list(dict.fromkeys(mapper(e) for e in _exclude_list(config)))
    lqc = dict(_lqc(config))
    if profile.rules.maps_layer_quant_config:  # the draft class's mapper rewrites the keys too (apply_dict)
        lqc = {mapper(k): v for k, v in lqc.items()}
    note = f"{cls_name}"
    if cls.exclude_mapper:
        note += f" maps exclude with {cls.exclude_mapper}"
    quantized, reason = True, ""
    if cls.whole_layer_exclude:
        mapped_prefix = mapper(prefix)
        if ExcludeMatcher(entries, profile.rules.exclude_match).matches(mapped_prefix):
            quantized = False
            reason = f"an exclude entry matches {mapped_prefix}, so {cls_name} builds the whole draft unquantized"
    if cls.remap_mtp_names:
        mtp_entries = [e for e in entries if e.startswith(prefix + ".")]
        extra = [profile.nextn_checkpoint_name(e, prefix) for e in mtp_entries]
        if any(".mlp.experts." in e for e in mtp_entries):
            extra.append(profile.draft_moe_coarse())
        entries = list(dict.fromkeys(entries + extra))
        lqc = {(profile.nextn_checkpoint_name(k, prefix) if k.startswith(prefix + ".") else k): v
               for k, v in lqc.items()}
        note += f"; _resolve_nextn_quant_config remaps {prefix}.* entries"
    never = list(profile.rules.never_quantized)
    if not cls.eh_proj_quantizable:
        never.append(r"\.eh_proj$")
    return BuildContext("draft", units, ExcludeMatcher(entries, profile.rules.exclude_match),
                        LayerConfigMatcher(lqc, profile.rules.layer_config_match), _any_of(never),
                        quantized, reason, note)


class _BuildFails(Exception):
    """The engine raises while building this unit; the error is already reported, its tensors are moot."""


class ProfileChecker:
    """All unit-level findings of one profile."""

    def __init__(self, profile: Profile, config: dict, modules: dict[str, Module], tp: int | None,
                 contract_cache: dict | None = None, shape_of=None):
        self.p = profile
        self.contract_cache = {} if contract_cache is None else contract_cache
        self._kinds: dict[int, str] = {}
        self.config = config
        self.modules = modules
        self.tp = tp
        self.findings: list[Finding] = []
        self.unsupported: dict[tuple, list[str]] = defaultdict(list)
        q = _q(config)
        self.global_cfg = q.get("global_quant_config") if isinstance(q.get("global_quant_config"), dict) else None
        ltqc = q.get("layer_type_quant_config")
        self.linear_type_cfg = (ltqc or {}).get(profile.rules.layer_type_config) \
            if isinstance(ltqc, dict) else None
        self.row_parallel = _any_of(profile.rules.row_parallel)
        self.shape_of = shape_of or (lambda _module: None)

    def add(self, severity: str, tensor: str | None, message: str, fix: str, rule: str) -> None:
        self.findings.append(Finding(severity, self.p.engine, (self.p.release,), tensor, message, fix, rule))

    def run(self, contexts: list[BuildContext]) -> list[Finding]:
        per_leaf = self.p.rules.moe.excluded_when == "per_leaf"
        for ctx in contexts:
            for unit in ctx.units:
                for part in self._leaf_groups(ctx, unit) if per_leaf and unit.kind == "moe" else [unit]:
                    res = self.resolve(ctx, part)
                    if res is not None:
                        self.check_tensors(ctx, part, res)
        for (source, kind, unit_kind, text), runtimes in self.unsupported.items():
            self.add("error", f"config.json:quantization_config.{source}",
                     f"{self.p.title} raises {text} for the {kind} scheme on {unit_kind} modules "
                     f"(e.g. {runtimes[0]}; {len(runtimes)} module(s))",
                     "use a scheme this engine supports (W-MXFP4+A-MXFP4 or FP8 W8A8 with activations) "
                     "or exclude these modules", "unsupported scheme")
        return self.findings

    # ---- resolution ------------------------------------------------------------------------------------

    def _leaf_groups(self, ctx: BuildContext, unit: Unit) -> list[Unit]:
        """Engines that build every expert as its own Linear (moe.excluded_when: per_leaf): experts sharing an
        exclude decision and a layer config resolve together, as plain linear units."""
        parts: dict[tuple, Unit] = {}
        for member, runtime in zip(unit.members, unit.shard_runtime):
            hit = ctx.layer_config.lookup(runtime)
            key = (ctx.exclude.matches(runtime), hit[0] if hit else None)
            part = parts.get(key)
            if part is None:
                part = parts[key] = Unit(runtime, "linear", [], [], mtp=unit.mtp)
            part.members.append(member)
            part.shard_runtime.append(runtime)
        return list(parts.values())

    def _loader_dequantizes(self, member: str) -> bool:
        """An unquantized module whose stored format the engine's loader dequantizes (rules: loader_dequantizes)."""
        stored = contract.stored_family(self.modules[member])
        return any(re.search(pattern, member) and stored in formats
                   for pattern, formats in self.p.rules.loader_dequantizes.items())

    def _built(self, unit: Unit) -> str:
        what = f"{self.p.title} builds {unit.runtime}"
        if unit.kind == "linear" and len(unit.members) > 1 and not unit.fused:
            what += f" and {len(unit.members) - 1} more expert Linear(s) alike"
        if unit.kind == "moe":
            what += f" (FusedMoE, {len(unit.members)} expert weights)"
        elif unit.fused:
            what += f" (fused from {', '.join(s.rsplit('.', 1)[-1] for s in unit.shard_runtime)})"
        return what

    def resolve(self, ctx: BuildContext, unit: Unit) -> Resolution | None:
        first = unit.members[0]
        if unit.missing_shards:
            self.add("error", f"{first}.weight", f"{self._built(unit)} but the checkpoint lacks shard(s) "
                     f"{', '.join(unit.missing_shards)}", "store every shard of the fused module",
                     "fused shards")
            return None
        # never-quantized patterns name module types (routers, eh_proj, heads): shards and experts share them;
        # the engine's own name counts too (engine rules build_prefixes: block_sparse_moe.gate built as mlp.gate)
        if ctx.never_quantized is not None and (ctx.never_quantized.search(first)
                                                or ctx.never_quantized.search(unit.shard_runtime[0])):
            if self._loader_dequantizes(first):
                return None  # built unquantized, and the loader turns this stored format into it
            return Resolution(None, "this module is never quantized by the engine (plain Linear / no quant "
                                    "method)")
        if not ctx.quantized:
            return Resolution(None, ctx.unquantized_reason)
        if unit.kind == "moe":
            try:
                excluded = self._moe_excluded(ctx, unit)
            except _BuildFails:
                return None
        else:
            names = self._lookup_names(ctx, unit)
            if unit.fused and self.p.rules.exclude_fused_name_first and ctx.exclude.matches(unit.runtime):
                names = [unit.runtime]  # an entry naming the fused module decides before its shards are looked at
            try:
                excluded = ignored(names if unit.fused else names[:1], ctx.exclude)
            except ShardConflict as c:
                hit = [s for s, v in c.decisions.items() if v]
                miss = [s for s, v in c.decisions.items() if not v]
                text = self.p.rules.errors.fused_exclude.format(
                    shards=[s.rsplit(".", 1)[-1] for s in unit.shard_runtime], layer=unit.runtime)
                self.add("error", f"{first}.weight", f"{self._built(unit)}: exclude matches {', '.join(hit)} "
                         f"but not {', '.join(miss)}; {self.p.title} raises {text}",
                         f"give every shard the same decision: add {', '.join(miss)} to exclude, or remove the "
                         f"entries matching {', '.join(hit)}", "fused shards")
                return None
            excluded = Resolution(None, "it is excluded", ctx.exclude.matching_entries(names[0])) \
                if excluded else None
        if excluded is not None:
            return excluded
        return self._scheme(ctx, unit)

    def _moe_excluded(self, ctx: BuildContext, unit: Unit) -> Resolution | None:
        rule = self.p.rules.moe
        coarse_hits = ctx.exclude.matching_entries(unit.runtime)
        if coarse_hits and rule.coarse_exclude == "assertion":
            self.add("error", f"{unit.members[0]}.weight",
                     f"{self._built(unit)}: exclude entry {coarse_hits[0]} matches the FusedMoE prefix; "
                     f"{self.p.title} raises {self.p.rules.errors.coarse_moe_exclude}",
                     f"remove {coarse_hits[0]} from exclude (this release cannot keep a FusedMoE unquantized)",
                     "moe coarse prefix")
            raise _BuildFails
        if coarse_hits:
            return Resolution(None, "its coarse FusedMoE prefix is excluded", coarse_hits)
        if rule.excluded_when == "coarse_or_any_leaf":
            leaves = ctx.exclude.any_entry_under(unit.runtime)
            if leaves:
                return Resolution(None, f"exclude lists expert leaves under {unit.runtime}", leaves[:3])
        return None

    @staticmethod
    def _lookup_names(ctx: BuildContext, unit: Unit) -> list[str]:
        """The names the engine checks exclude / layer_quant_config with: a fused module's shards, or the fused
        name itself where the class's packed mapping does not expand it (BuildContext.whole_fused)."""
        if unit.fused and unit.fused in ctx.whole_fused:
            return [unit.runtime]
        return unit.shard_runtime

    def _scheme(self, ctx: BuildContext, unit: Unit) -> Resolution | None:
        names = self._lookup_names(ctx, unit) if unit.fused else [unit.runtime]
        found = [self._layer_config(ctx, n, unit) for n in names]
        if any(f[1] != found[0][1] for f in found):
            text = self.p.rules.errors.fused_config.format(
                shards=[s.rsplit(".", 1)[-1] for s in names], layer=unit.runtime)
            self.add("error", f"{unit.members[0]}.weight",
                     f"{self._built(unit)}: shards take different configs ({', '.join(f[0] for f in found)}); "
                     f"{self.p.title} raises {text}", "give every shard the same layer_quant_config entry",
                     "fused shards")
            return None
        source, cfg = found[0]
        if cfg is None:
            return None  # no global config: reported by the schema checks
        kind = self._kinds.get(id(cfg))
        if kind is None:
            kind = self._kinds[id(cfg)] = classify(cfg)
        if kind == "unmodelled":
            self.add("warning", f"config.json:quantization_config.{source}",
                     f"{self.p.title}: the scheme of {source} is not modelled by this preflight; tensors of "
                     f"{unit.runtime} were not checked", "check this scheme on a real engine", "scheme")
            return None
        schemes = self.p.rules.schemes
        table = schemes.moe if unit.kind == "moe" else schemes.linear
        verdict = table.get(kind, table.get("other"))
        if verdict == "ok" and unit.kind == "moe" and kind == "fp8" and schemes.fp8_moe_qschemes is not None:
            pair = [cfg["weight"].get("qscheme"), (cfg.get("input_tensors") or {}).get("qscheme")]
            static_channel = pair[1] == "per_channel" and cfg["input_tensors"].get("is_dynamic") is False
            if pair not in schemes.fp8_moe_qschemes or static_channel:
                verdict = schemes.fp8_moe_error
        if verdict != "ok":
            self.unsupported[(source, kind, unit.kind, verdict)].append(unit.runtime)
            return None
        failure = self._module_failure(unit, kind, cfg)
        if failure is not None:
            self.add("error", f"{unit.members[0]}.weight",
                     f"{self._built(unit)} as {kind} ({source}), and its weight loader raises {failure.error}",
                     "keep this module BF16 or give it a scheme this release loads", "module scheme")
            return None
        return Resolution(kind, f"from {source}", layer_cfg=cfg)

    def _module_failure(self, unit: Unit, kind: str, cfg: dict):
        """The recorded loader failure (schemes.module_failures) of this module with this scheme, if any."""
        qscheme = (cfg.get("weight") or {}).get("qscheme") if isinstance(cfg.get("weight"), dict) else None
        for failure in self.p.rules.schemes.module_failures:
            if failure.kind == kind and failure.weight_qscheme in (None, qscheme) \
                    and re.search(failure.module, unit.runtime):
                return failure
        return None

    def _layer_config(self, ctx: BuildContext, name: str, unit: Unit) -> tuple[str, dict | None]:
        hit = ctx.layer_config.lookup(name)
        if hit is None and unit.kind == "moe" and self.p.rules.moe.config_probe:
            for proj in ("down_proj", "gate_proj", "up_proj", "gate_up_proj"):
                for probe in (f"{name}.0.{proj}", f"{name}.{proj}"):
                    hit = hit or ctx.layer_config.lookup(probe)
        if hit is not None:
            return f"layer_quant_config[{hit[0]!r}]", hit[1]
        if unit.kind == "linear" and isinstance(self.linear_type_cfg, dict):
            return f"layer_type_quant_config[{self.p.rules.layer_type_config!r}]", self.linear_type_cfg
        return "global_quant_config", self.global_cfg

    # ---- tensors ---------------------------------------------------------------------------------------

    def check_tensors(self, ctx: BuildContext, unit: Unit, res: Resolution) -> None:
        mismatched: list[tuple[str, contract.TensorIssue]] = []
        for member in unit.members:
            tp = self.tp if self.tp and self.row_parallel and self.row_parallel.search(member) else None
            key = (member, res.kind, id(res.layer_cfg), tp)
            issues = self.contract_cache.get(key)
            if issues is None:
                issues = self.contract_cache[key] = contract.check_module(self.modules[member], res.kind,
                                                                          res.layer_cfg, tp,
                                                                          self.shape_of(member))
            for issue in issues:
                if issue.family_mismatch:
                    mismatched.append((member, issue))
                elif issue.stray:
                    self._stray(unit, res, issue)
                else:
                    self.add("error", issue.tensor,
                             f"{self._built(unit)} as {contract.KIND_LABEL.get(res.kind, res.kind)}: "
                             f"{issue.tensor} is {issue.problem}, expected {issue.expected}",
                             "re-export this tensor in the layout the scheme defines (quant/verify/contract.py lists "
                             "each scheme's tensors)",
                             "tensor contract" + (" (TP)" if "TP" in issue.expected else ""))
        if mismatched:
            self._family_mismatch(ctx, unit, res, mismatched)

    def _stray(self, unit: Unit, res: Resolution, issue: contract.TensorIssue) -> None:
        """A tensor the module as built has no parameter for: a warning where this release's load_weights drops it,
        an error with the engine's own text where it raises (engine rules stray_tensors; unrecorded: an error)."""
        built = f"{self._built(unit)} as {contract.KIND_LABEL.get(res.kind, res.kind)}"
        entry = self.p.stray_tensor(issue.tensor, self.config)
        if entry is not None and entry.error is None:
            self.add("warning", issue.tensor, f"{built}: {issue.tensor} ({issue.problem}) has no parameter there and "
                     f"is ignored by the loader", "drop it from the export (it is never read)", "stray tensor")
            return
        raises = f"; {self.p.title} raises {entry.error}" if entry is not None else ""
        self.add("error", issue.tensor,
                 f"{built}: {issue.tensor} is {issue.problem}, expected {issue.expected}{raises}",
                 "drop it from the export: the module as built has no parameter for it, and this release's loader "
                 "refuses what it cannot place", "tensor contract")

    def _expected_shape(self, unit: Unit, res: Resolution) -> str:
        shapes = [self.shape_of(m) or contract.logical_shape(self.modules[m]) for m in unit.members]
        if not unit.fused or None in shapes:
            each = " per expert" if len(shapes) > 1 else ""
            return contract.expected_weight(res.kind, shapes[0]) + each if shapes[0] else "?"
        out_total = sum(s[0] for s in shapes)
        return contract.expected_weight(res.kind, (out_total, shapes[0][1]))

    def _family_mismatch(self, ctx: BuildContext, unit: Unit, res: Resolution,
                         mismatched: list[tuple[str, contract.TensorIssue]]) -> None:
        member, issue = mismatched[0]
        others = f" (and {len(mismatched) - 1} more of its {len(unit.members)} weights)" \
            if len(mismatched) > 1 else ""
        label = contract.KIND_LABEL.get(res.kind, res.kind)
        built = self._built(unit) + (" unquantized" if res.kind is None else f" as {label}")
        head = f"{built} and expects {self._expected_shape(unit, res)}, but {issue.tensor} is {issue.problem}{others}"
        stored = contract.stored_family(self.modules[member])
        if res.kind is None:
            why = res.reason + (f" (exclude entries: {', '.join(res.entries)})" if res.entries else "")
            message = f"{head}; unquantized because {why}"
            if res.entries:
                fix = f"remove {', '.join(res.entries)} from exclude, or store {unit.members[0]} in BF16"
            else:
                fix = f"store {member} in BF16 (the engine builds it unquantized)"
            rule = "mtp eh_proj" if ".eh_proj" in member else "dtype mismatch"
        elif stored == "float":
            message = head + (f" ({ctx.exclude_note})" if ctx.exclude_note else "")
            fix, rule = self._exclude_fix(ctx, unit)
        else:
            message = f"{head}; the {label} scheme comes {res.reason}"
            fix = (f"add a layer_quant_config key that {self.p.title} matches against {unit.runtime} "
                   f"(it matches runtime names; keys are not remapped for the draft)")
            rule = "mtp layer_quant_config" if ctx.label == "draft" else "layer_quant_config"
        self.add("error", issue.tensor, message, fix, rule)

    def _exclude_fix(self, ctx: BuildContext, unit: Unit) -> tuple[str, str]:
        mtp_rule = "mtp runtime names" if ctx.label == "draft" and self.p.rules.mtp.draft_naming == "nextn" \
            else None
        if ".eh_proj" in unit.runtime:
            mtp_rule = "mtp eh_proj"
        if unit.kind != "moe":
            names = self._lookup_names(ctx, unit)
            return f"add {' and '.join(names)} to exclude", mtp_rule or "dtype mismatch"
        moe = self.p.rules.moe
        rule = mtp_rule or ("moe coarse prefix" if ctx.label == "draft" else "moe coarse prefix")
        if moe.excluded_when == "coarse" and moe.coarse_exclude == "unquantized":
            return (f"add {unit.runtime} to exclude ({self.p.title} looks the FusedMoE up by this coarse "
                    "prefix; per-expert entries do not count)", rule)
        if moe.excluded_when == "coarse_or_any_leaf":
            return f"list the expert leaves (e.g. {unit.shard_runtime[0]}) in exclude", rule
        return moe.unexcludable_fix, rule
