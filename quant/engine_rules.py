"""The schema of the engine rules (quant/manifests/engines/): every rule an engine profile can state, declared once
with its type, its default and what it means, and the reader that turns the YAML into typed, frozen `EngineRules`.

An engine's engine.yaml holds its engine-wide rules, each release file only the rules that differ
(quant/engine_files.py reads the folder). Both are checked against this schema when read: an unknown or misspelled
key (`maps_exclud` in sglang/0.5.19.yaml) or a value of the wrong type is a QuantError naming the file, the key path
and the closest declared spelling, instead of a rule silently left at its default. A release's rules are the
engine-wide ones (or those of the release it inherits) with the release's overrides merged in (`merge`: mappings
merge key by key, anything else is replaced; a release cannot remove a mapping entry).

Code reads rules as attributes (`profile.rules.moe.excluded_when`) or asks the profile (quant.engines.Profile);
no engine name appears in the branches of the engines layer (quant/engines.py, quant/engine_files.py, this file)
or of quant/verify/.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from collections.abc import Iterable
from typing import Any, Literal, Union

from quant.errors import QuantError

_REQUIRED = "required"
# A rule keyed by config.json's architectures[0]: `quant engines show ARCH` keeps that architecture's entry only.
_PER_ARCHITECTURE = "per_architecture"


def rule(default: Any, meaning: str) -> Any:
    """A rule key with its default and its one-line meaning."""
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"meaning": meaning})
    return field(default=default, metadata={"meaning": meaning})


def by_architecture(meaning: str) -> Any:
    """A rule key mapping architecture -> its rule (default: no architecture has one)."""
    return field(default_factory=dict, metadata={"meaning": meaning, _PER_ARCHITECTURE: True})


def required(meaning: str) -> Any:
    """A rule key every merged profile must state (engine-wide or in the release)."""
    return field(metadata={"meaning": meaning, _REQUIRED: True})


SchemeKind = Literal["mxfp4", "fp8", "w4a8_mxfp4_fp8", "mxfp4_weight_only", "mxfp4_static_input",
                     "fp8_weight_only", "mxfp8", "mxfp8_block", "other", "quantized_output_or_bias"]
MergedRule = Literal["last_shard_only", "all_shards"]


@dataclass(frozen=True, kw_only=True)
class Errors:
    fused_exclude: str = rule("ValueError (shards differ)",
                              "what the engine raises when exclude matches some shards of a fused module only")
    fused_config: str = rule("ValueError (shards differ)",
                             "what the engine raises when the shards of a fused module take different layer configs")
    coarse_moe_exclude: str | None = rule(None, "what the engine raises when an exclude entry matches a FusedMoE "
                                                "prefix it cannot keep unquantized (moe.coarse_exclude: assertion)")


@dataclass(frozen=True, kw_only=True)
class BuildPrefix:
    match: str = required("regex on the checkpoint module name")
    replace: str = required("its replacement: the name the engine builds the module under")
    into: list[str] = rule([], "the module is built as several, one per output chunk, each under the name with the "
                               "match replaced by one of these (transformers' Chunk converters); [] = one module")
    source: str = rule("", "where the rename was read")


@dataclass(frozen=True, kw_only=True)
class Fp8Partitions:
    sizes: dict[str, list[str]] = rule({}, "partition size name -> the text-config keys whose product it is")
    partitions: dict[str, list[str]] = rule({}, "checkpoint shard -> the partition sizes it is split into")


@dataclass(frozen=True, kw_only=True)
class DequantGrid:
    raises: str = required("message when a dimension does not divide into the scale grid")
    wrong: str = required("message when the grid divides it into blocks other than 128")


@dataclass(frozen=True, kw_only=True)
class MtpNamespace:
    prefix: str = required("the namespace MTP heads are stored under (e.g. 'mtp.')")
    any_exclude_unquantizes: bool = rule(False, "any exclude entry under the prefix builds the whole draft unquantized")
    never_quantized: list[str] = rule([], "regexes of draft modules the engine never quantizes")
    layer_prefix: str | None = rule(
        None, "the checkpoint prefix the draft loads MTP layer {k} from, k = 0 .. num_nextn_predict_layers - 1 "
              "(DeepSeek-V4: 'mtp.{k}.'); none: the layers are not checked one by one")
    draft_names: list[BuildPrefix] = rule(
        [], "regex renames, applied in order, of a checkpoint module under the prefix to the name the draft builds "
            "it under and looks it up by in the quant config ('{N}' in a replacement: num_hidden_layers; '{N+k}': "
            "that plus the match's group k); none: the checkpoint's names")
    maps_exclude: bool = rule(
        True, "the draft's quant config rewrites exclude and layer_quant_config keys with the same renames, so "
              "entries written with checkpoint names match; false: they must name the draft's modules")


@dataclass(frozen=True, kw_only=True)
class Moe:
    excluded_when: Literal["coarse", "coarse_or_any_leaf", "per_leaf"] = required(
        "what exclude entry keeps a FusedMoE unquantized: its coarse prefix, that or any expert leaf, or "
        "each expert Linear on its own")
    coarse_exclude: Literal["unquantized", "assertion"] = required(
        "what an exclude entry on the FusedMoE prefix does: builds it unquantized, or fails an assertion")
    config_probe: bool = rule(False, "layer_quant_config is also probed with expert-leaf names of the FusedMoE")
    unexcludable_fix: str = rule(
        "no exclude entry keeps a FusedMoE unquantized in this release (per-expert entries are ignored, a coarse "
        "entry raises AssertionError): quantize these experts",
        "the fix offered for a BF16 FusedMoE when no exclude entry can keep it unquantized")


@dataclass(frozen=True, kw_only=True)
class ModuleFailure:
    module: str = required("regex on the module's runtime name")
    kind: SchemeKind = required("the scheme kind it fails with")
    weight_qscheme: str | None = rule(None, "the weight qscheme it fails with (none: any)")
    error: str = required("what the engine raises loading it")
    source: str = rule("", "where it was read or run")


@dataclass(frozen=True, kw_only=True)
class StrayTensor:
    match: str = required("regex searched in the checkpoint name of a tensor its module, as built, has no parameter "
                          "for (an input_scale beside a BF16 or dynamic-MXFP4 weight, a leaked second scale)")
    error: str | None = rule(None, "what the loader raises on it; none: the loader drops it without error")
    source: str = rule("", "where it was read or run")


@dataclass(frozen=True, kw_only=True)
class Schemes:
    linear: dict[SchemeKind, str] = rule({}, "scheme kind -> 'ok' or what the engine raises for a Linear module")
    moe: dict[SchemeKind, str] = rule({}, "scheme kind -> 'ok' or what the engine raises for a FusedMoE")
    fp8_moe_qschemes: list[list[str]] | None = rule(
        None, "the [weight, input] qscheme pairs an FP8 FusedMoE accepts (none: any)")
    fp8_moe_error: str | None = rule(None, "what the engine raises for another FP8 FusedMoE qscheme pair")
    module_failures: list[ModuleFailure] = rule(
        [], "modules the engine builds with a scheme it accepts but fails to load (a module-specific loader path)")


@dataclass(frozen=True, kw_only=True)
class ConfigSchema:
    export_required: str | None = rule(None, "what the engine raises without quantization_config.export")
    kv_cache_group_list: str | None = rule(None, "what the engine raises when export.kv_cache_group is no list")
    kv_cache_keys: Literal["exact", "exact_or_fnmatch"] | None = rule(
        None, "how kv_cache_group names are matched against layer_quant_config keys (none: not checked)")
    exclude_required: bool = rule(False, "a missing exclude list raises")
    dict_keys: list[str] = rule([], "quantization_config keys that must be objects")
    required_keys: list[str] = rule([], "quantization_config keys that must be present")
    layer_config_keys: list[str] = rule([], "keys every layer config must have (none: not checked)")
    tensor_spec_keys: list[str] = rule([], "keys every tensor spec must have (documentation: dtype is checked)")
    loader_overrides_packed_mapping: bool = rule(
        False, "the loader injects its own packed_modules_mapping, so one in the checkpoint config is ignored")


@dataclass(frozen=True, kw_only=True)
class DraftClass:
    exclude_mapper: dict[str, str] = rule({}, "substring mapper the loader applies to exclude before building")
    whole_layer_exclude: bool = rule(False, "an exclude entry matching the mapped MTP layer unquantizes the draft")
    remap_mtp_names: bool = rule(False, "exclude entries and layer_quant_config keys of the MTP layer are "
                                        "remapped to the draft's runtime names")
    eh_proj_quantizable: bool = rule(True, "eh_proj is built with the quant config")


@dataclass(frozen=True, kw_only=True)
class Mtp:
    builds_mtp: bool = rule(True, "the engine builds an MTP/NextN draft from model.layers.{N}.*")
    layer_index: str = rule("num_hidden_layers", "the text-config key giving the first MTP layer's index")
    max_layers: int | None = rule(None, "the most MTP layers the engine builds (none: no limit)")
    never_quantized: list[str] = rule([], "regexes of draft modules the engine never quantizes")
    missing_layer_error: str | None = rule(None, "what the engine raises when a declared MTP layer is missing "
                                                 "(none: a warning)")
    draft_naming: Literal["checkpoint", "nextn"] = rule(
        "checkpoint", "names the draft is built under: the checkpoint's, or the NextN runtime names below "
                      "(spec_names -> spec_prefix, the rest -> decoder_prefix, per draft class)")
    draft_layers: Literal["all", "first"] = rule(
        "all", "the declared MTP layers the draft loads: every one, or the first (model.layers.{N}) only")
    draft_names: dict[str, list[BuildPrefix]] = by_architecture(
        "checkpoint: architecture -> regex renames, applied in order, of an MTP layer's checkpoint module to the "
        "name the draft builds it under and looks it up by in the quant config it shares with the target "
        "(a wrapper's draft building model.language_model.layers.{N}.* as model.layers.{N}.*); none: the "
        "checkpoint's names")
    exclude_runtime_names: bool = rule(
        False, "the exclude entries written for a module of a layer the draft loads also name it by the draft's "
               "runtime name (nextn: a draft class that matches exclude without remapping it needs that spelling)")
    exclude_moe_coarse: bool = rule(
        False, "with exclude_runtime_names, a routed-expert leaf of that layer also writes the draft's coarse "
               "FusedMoE prefix (decoder_prefix.moe_coarse) into exclude")
    skip: list[str] = rule([], "nextn: substrings of MTP modules the draft does not load")
    spec_names: list[str] = rule([], "nextn: substrings of MTP modules built under spec_prefix")
    decoder_prefix: str = rule("", "nextn: the runtime prefix of the draft's decoder layer")
    spec_prefix: str = rule("", "nextn: the runtime prefix of the spec modules")
    moe_coarse: str = rule("", "nextn: the FusedMoE prefix under decoder_prefix")
    draft_class: dict[str, str] = by_architecture("nextn: target architecture -> draft class")
    default_draft_class: str | None = rule(None, "nextn: the draft class of a target architecture not in draft_class")
    draft_classes: dict[str, DraftClass] = rule({}, "nextn: draft class -> how it reads exclude")


@dataclass(frozen=True, kw_only=True)
class EngineRules:
    """One engine release's rules (engine-wide with the release's overrides merged)."""

    sources: list[str] = rule([], "where the release's behaviour was read or run")
    exclude_match: Literal["exact_or_regex", "quark_fnmatch"] = required("how exclude entries match module names")
    layer_config_match: Literal["fnmatch", "substring_or_fnmatch"] = required(
        "how layer_quant_config keys match module names")
    layer_type_config: str = required("the layer_type_quant_config key linear modules are looked up by "
                                      "('ignored': none matches)")
    errors: Errors = rule(Errors(), "messages of errors raised while building modules")
    packed_modules_mapping: dict[str, list[str]] = rule({}, "fused module -> the checkpoint shards it is built from")
    unexpanded_fused: dict[str, list[str]] = by_architecture(
        "architecture -> fused modules matched by the fused name only (not expanded into shards)")
    exclude_fused_name_first: bool = rule(
        False, "an exclude entry matching a fused module's own name excludes it before its shards are expanded")
    name_mappers: dict[str, dict[str, str]] = by_architecture(
        "architecture -> the model class's WeightsMapper: checkpoint -> runtime name prefixes (a key starting "
        "with '.' is a substring replaced once, before the prefixes: orig_to_new_substr)")
    maps_exclude: bool = rule(False, "exclude is rewritten with the name mapper before matching")
    exclude_prefix_aliases: list[str] = rule(
        [], "prefixes the quant config also strips from each exclude entry it maps, keeping both spellings")
    maps_layer_quant_config: bool = rule(
        False, "layer_quant_config keys are rewritten with the name mapper before matching")
    build_prefixes: dict[str, list[BuildPrefix]] = by_architecture(
        "architecture -> modules built under a quant-config prefix other than their checkpoint path")
    block_fp8_moe: Literal["validate", "refine"] | None = rule(
        None, "how a block-FP8 FusedMoE is sized when I/TP is not a multiple of 128 (none: not checked)")
    block_fp8_merged: MergedRule | dict[str, MergedRule] | None = rule(
        None, "which shards of a block-FP8 merged GEMM must be whole blocks (per fused name, or 'default')")
    block_fp8_partitions: dict[str, Fp8Partitions] = rule(
        {}, "fused name -> output partitions that must each be whole 128-row blocks")
    block_fp8_row_tp: str | None = rule(None, "what the engine raises when a row-parallel block-FP8 input does not "
                                              "split into whole blocks per TP rank (none: not checked)")
    block_fp8_dequant_grid: DequantGrid | None = rule(
        None, "block FP8 dequantized with a block derived from the scale grid (none: not affected)")
    mtp_namespace: dict[str, MtpNamespace] = by_architecture(
        "architecture -> its MTP heads stored under their own namespace (Qwen3.5 mtp.*, DeepSeek-V4 mtp.{k}.*)")
    never_quantized: list[str] = rule([], "regexes of modules the engine builds without asking the quant config")
    never_quantized_by_architecture: dict[str, list[str]] = by_architecture(
        "architecture -> regexes of modules this architecture's model never builds or never quantizes")
    layer_types_length: str | None = rule(
        None, "what the engine raises reading a config.json (or its text_config) whose layer_types list has another "
              "length than num_hidden_layers (none: not checked)")
    transformers: str | None = rule(
        None, "the transformers releases this release runs with, as its wheel's Requires-Dist says ('==5.6.0', "
              "'<5.18.0,>=5.10.4'; none: not known): a model type only a newer transformers knows (the family's "
              "transformers_since), and not in config_registry, cannot be read (scripts/release_parsing.py)")
    config_registry: list[str] = rule(
        [], "model types whose config.json the engine parses with a config class of its own, not transformers' "
            "AutoConfig (a model type neither knows: the engine cannot read config.json)")
    not_modelled: dict[str, str] = rule(
        {}, "what the release's classes declare that this profile leaves out on purpose, keyed as "
            "scripts/check_engine_profile.py names the difference ('name_mappers.<architecture>'), "
            "each with why (the checker prints it as a note, not a difference)")
    loader_dequantizes: dict[str, list[str]] = rule(
        {}, "regex of an unquantized module -> stored formats the loader dequantizes into it")
    row_parallel: list[str] = rule([], "regexes of row-parallel modules (TP splits their input)")
    shared_expert_fusion_veto: bool = rule(
        False, "an excluded shared expert disables shared-expert fusion for every layer (performance warning)")
    stray_tensors: dict[str, list[StrayTensor]] = by_architecture(
        "architecture -> how its load_weights treats a tensor its module has no parameter for, first matching "
        "entry wins; a tensor no entry matches is taken as rejected (an error naming it)")
    moe: Moe = required("how FusedMoE modules are excluded")
    schemes: Schemes = rule(Schemes(), "which schemes the engine builds")
    config_schema: ConfigSchema = rule(ConfigSchema(), "quantization_config schema checks")
    mtp: Mtp = rule(Mtp(), "the MTP/NextN draft")


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`base` with `override` applied: mappings merge key by key, anything else is replaced."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def meanings(cls: type = EngineRules, prefix: str = "") -> dict[str, str]:
    """Every declared rule key path -> its meaning (nested sections included)."""
    out: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        out[prefix + f.name] = f.metadata.get("meaning", "")
        for sub in _sections(_hints(cls)[f.name]):
            out.update(meanings(sub, prefix + f.name + "."))
    return out


def _sections(tp: Any) -> list[type]:
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return [tp]
    return [s for arg in typing.get_args(tp) if not _is_literal(tp) for s in _sections(arg)]


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _is_literal(tp: Any) -> bool:
    return typing.get_origin(tp) is Literal


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


class RuleReader:
    """Reads raw YAML rules against the schema; each error names its file and the key path inside it."""

    def __init__(self, file: object) -> None:
        self.file = file

    def fail(self, where: str, problem: str) -> QuantError:
        return QuantError(f"{self.file}: {where}: {problem}" if where else f"{self.file}: {problem}")

    def unknown(self, where: str, key: object, allowed: Iterable[str]) -> QuantError:
        close = difflib.get_close_matches(str(key), list(allowed), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else f" (known: {', '.join(allowed)})"
        return self.fail(_at(where, key), f"unknown rule key{hint}")

    def section(self, cls: type, raw: Any, where: str, partial: bool) -> Any:
        """`raw` checked against dataclass `cls`; built with defaults unless `partial` (a release's overrides)."""
        if not isinstance(raw, dict):
            raise self.fail(where, f"expected a mapping, got {type(raw).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key in raw:
            if key not in fields:
                raise self.unknown(where, key, fields)
        values: dict[str, Any] = {}
        for name, f in fields.items():
            if name in raw:
                values[name] = self.value(raw[name], _hints(cls)[name], _at(where, name), partial)
            elif f.metadata.get(_REQUIRED) and not partial:
                raise self.fail(where, f"missing rule key '{name}' ({f.metadata['meaning']})")
        return None if partial else cls(**values)

    def value(self, value: Any, tp: Any, where: str, partial: bool) -> Any:
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            return self.section(tp, value, where, partial)
        if _is_union(tp):
            args = typing.get_args(tp)
            if value is None and type(None) in args:
                return None
            for arg in args:
                if arg is not type(None) and _shape_fits(value, arg):
                    return self.value(value, arg, where, partial)
            raise self.fail(where, f"expected {_describe(tp)}, got {type(value).__name__}")
        if _is_literal(tp):
            allowed = [str(a) for a in typing.get_args(tp)]
            if value not in typing.get_args(tp):
                close = difflib.get_close_matches(str(value), allowed, n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise self.fail(where, f"{value!r} is not one of {', '.join(allowed)}{hint}")
            return value
        origin = typing.get_origin(tp)
        if origin is dict:
            key_tp, value_tp = typing.get_args(tp)
            if not isinstance(value, dict):
                raise self.fail(where, f"expected a mapping, got {type(value).__name__}")
            out = {}
            for key, item in value.items():
                if _is_literal(key_tp) and key not in typing.get_args(key_tp):
                    raise self.unknown(where, key, [str(a) for a in typing.get_args(key_tp)])
                if not isinstance(key, str):
                    raise self.fail(f"{where}.{key}", f"expected a string key, got {type(key).__name__}")
                out[key] = self.value(item, value_tp, f"{where}.{key}", partial)
            return out
        if origin is list:
            (item_tp,) = typing.get_args(tp)
            if not isinstance(value, list):
                raise self.fail(where, f"expected a list, got {type(value).__name__}")
            return [self.value(item, item_tp, f"{where}[{i}]", partial) for i, item in enumerate(value)]
        if tp is Any:
            return value
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise self.fail(where, f"expected {_describe(tp)}, got {type(value).__name__}")
        return value


def _at(where: str, key: object) -> str:
    """The key path of `key` inside `where` ('' at the top of a file)."""
    return f"{where}.{key}" if where else str(key)


def _shape_fits(value: Any, tp: Any) -> bool:
    """Whether `value` has the Python shape of type `tp` (picks the branch of a union)."""
    if dataclasses.is_dataclass(tp) or typing.get_origin(tp) is dict:
        return isinstance(value, dict)
    if typing.get_origin(tp) is list:
        return isinstance(value, list)
    if _is_literal(tp):
        return any(type(value) is type(a) for a in typing.get_args(tp))
    return isinstance(value, tp) if isinstance(tp, type) else True


def _describe(tp: Any) -> str:
    if _is_union(tp):
        return " or ".join(_describe(a) for a in typing.get_args(tp) if a is not type(None))
    if _is_literal(tp):
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp) or typing.get_origin(tp) is dict:
        return "a mapping"
    if typing.get_origin(tp) is list:
        return "a list"
    return getattr(tp, "__name__", str(tp))


def check_overrides(raw: Any, file: object) -> None:
    """Rules as a file states them (engine-wide or a release's overrides) checked against the schema: a QuantError
    naming the file and the key path on an unknown key or a value of the wrong type."""
    RuleReader(file).section(EngineRules, raw, "", partial=True)


def typed_rules(merged: dict[str, Any], file: object) -> EngineRules:
    """One release's merged rules as typed, frozen EngineRules (`file`: the release's, named by any error)."""
    rules: EngineRules = RuleReader(file).section(EngineRules, merged, "", partial=False)
    return rules


def for_architecture(section: Any, arch: str) -> dict[str, Any]:
    """The rules of `section` (EngineRules or a section of it) as a checkpoint of architecture `arch` meets them,
    as plain data: a rule keyed by architecture reduced to that architecture's entry (left out when it has none),
    every other rule as it is."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if f.metadata.get(_PER_ARCHITECTURE):
            if arch in value:
                out[f.name] = _plain(value[arch])
        elif dataclasses.is_dataclass(value):
            out[f.name] = for_architecture(value, arch)
        else:
            out[f.name] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def architectures_named(section: Any) -> set[str]:
    """Every architecture a rule keyed by architecture names in `section` (EngineRules or a section of it)."""
    out: set[str] = set()
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if f.metadata.get(_PER_ARCHITECTURE):
            out |= set(value)
        elif dataclasses.is_dataclass(value):
            out |= architectures_named(value)
    return out
