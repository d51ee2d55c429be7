"""Engine profiles (SGLang, vLLM, transformers) read from manifests/engines.yaml, and the names each engine
gives a checkpoint module when it looks up its quantization scheme.

A `Profile` is one engine release with its rules merged (engine-wide rules overridden by the release's), typed
by the schema in quant/engine_rules.py (an unknown or misspelled key in engines.yaml is an error when it is read).
`exclude_aliases` renders the exclude entries every engine needs for one checkpoint module; the quantizer
uses it to write `exclude`, verify-manifest uses the same naming rules to predict load failures.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

import yaml

from quant.engine_rules import EngineRules, Mtp, MtpNamespace, check_engines, engine_wide_rules, release_rules
from quant.families import text_config
from quant.errors import QuantError
from quant.paths import MANIFESTS_DIR

ENGINES_FILE = MANIFESTS_DIR / "engines.yaml"
ENGINE_NAMES = ("sglang", "vllm", "transformers")
# A decoder layer's module (model.layers.N.*, a VL wrapper's model.language_model.layers.N.* or
# language_model.model.layers.N.*): (layer prefix, index, module within the layer).
_LAYER = re.compile(r"^((?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+))\.(.+)$")
_EXPERT_LEAF = re.compile(r"^mlp\.experts\.\d+\.")


@lru_cache(maxsize=1)
def engine_data() -> dict:
    try:
        with open(ENGINES_FILE) as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise QuantError(f"{ENGINES_FILE}: cannot read engine profiles ({e})") from None
    check_engines(data, ENGINES_FILE)
    return data


@dataclass(frozen=True)
class Profile:
    """One engine release: `rules` are the engine-wide rules with the release's overrides applied."""

    engine: str
    release: str
    title: str
    rules: EngineRules

    @property
    def label(self) -> str:
        return f"{self.engine}=={self.release}"

    @property
    def sources(self) -> list[str]:
        return list(self.rules.sources)


def releases(engine: str) -> list[str]:
    return list(_engine(engine)["releases"])


def _engine(engine: str) -> dict:
    engines = engine_data()["engines"]
    if engine not in engines:
        raise QuantError(f"unknown engine '{engine}' (known: {', '.join(engines)})")
    return engines[engine]


@lru_cache(maxsize=None)
def profile(engine: str, release: str) -> Profile:
    data = _engine(engine)
    if release not in data["releases"]:
        raise QuantError(f"unknown {engine} release '{release}' (profiles exist for: "
                         f"{', '.join(data['releases'])}; see {ENGINES_FILE})")
    return Profile(engine, release, data.get("title", engine), release_rules(data, engine, release, ENGINES_FILE))


@lru_cache(maxsize=None)
def engine_rules(engine: str) -> EngineRules:
    """The engine-wide rules of `engine` (no release's overrides): what every release of it shares."""
    return engine_wide_rules(_engine(engine), engine, ENGINES_FILE)


def engine_names() -> list[str]:
    """The engines engines.yaml profiles, in its order."""
    return list(engine_data()["engines"])


# What a preflight checks when no engine is named: the engines that serve the checkpoint. transformers' own Quark
# loading cannot load quantized routed experts at all (manifests/engines.yaml), so it is checked when asked for.
SERVING_ENGINES = ("sglang", "vllm")


def select_profiles(specs: list[str] | None) -> list[Profile]:
    """Profiles for engine specs: "all", "sglang" (its default releases), "sglang==0.5.12" or
    "sglang==latest" (the newest release profiled); none: the serving engines (SERVING_ENGINES)."""
    out: list[Profile] = []
    for spec in specs or list(SERVING_ENGINES):
        for item in str(spec).split(","):
            item = item.strip()
            if not item:
                continue
            if item == "all":
                names = [(e, None) for e in engine_data()["engines"]]
            elif "==" in item:
                engine, release = item.split("==", 1)
                names = [(engine.strip(), release.strip())]
            else:
                names = [(item, None)]
            for engine, release in names:
                if release == "latest":
                    release = releases(engine)[-1]
                chosen = [release] if release else _engine(engine).get("default_releases") or releases(engine)
                for r in chosen:
                    p = profile(engine, r)
                    if p not in out:
                        out.append(p)
    if not out:
        raise QuantError("no engine selected (use sglang, vllm, transformers or all)")
    return out


# ---- MTP / NextN naming ------------------------------------------------------------------------------

def mtp_layers(config: dict) -> range:
    """Checkpoint layer indices of the MTP/NextN layers: num_hidden_layers .. + num_nextn_predict_layers."""
    cfg = text_config(config)
    n = int(cfg.get("num_hidden_layers") or 0)
    k = int(cfg.get("num_nextn_predict_layers") or 0)
    return range(n, n + k)


def layer_index(module: str) -> int | None:
    m = _LAYER.match(module)
    return int(m.group(2)) if m else None


def layer_prefix(module: str) -> str | None:
    """The checkpoint prefix of `module`'s decoder layer (model.layers.4, model.language_model.layers.4), or None."""
    m = _LAYER.match(module)
    return m.group(1) if m else None


def split_mtp(module: str, config: dict) -> tuple[int, str] | None:
    """(layer index, sub-module name) when `module` lies in a declared MTP layer, else None."""
    m = _LAYER.match(module)
    if m and int(m.group(2)) in mtp_layers(config):
        return int(m.group(2)), m.group(3)
    return None


def nextn_draft_rules() -> list[Mtp]:
    """The MTP rules of every engine whose draft carries runtime names of its own (mtp.draft_naming: nextn)."""
    rules = [engine_rules(name).mtp for name in engine_names()]
    return [r for i, r in enumerate(rules) if r.draft_naming == "nextn" and r not in rules[:i]]


def sglang_mtp_rule() -> Mtp:
    return engine_rules("sglang").mtp


def nextn_name(rule: Mtp, sub: str) -> str | None:
    """The NextN draft's runtime name for MTP sub-module `sub` under `rule` (engines.yaml mtp, draft_naming: nextn);
    None when the draft does not load it (`skip`)."""
    if any(s in sub for s in rule.skip):
        return None
    if any(s in sub for s in rule.spec_names):
        return f"{rule.spec_prefix}.{sub}"
    return f"{rule.decoder_prefix}.{sub}"


def nextn_moe_coarse(rule: Mtp) -> str:
    """The NextN draft's FusedMoE prefix under `rule`."""
    return f"{rule.decoder_prefix}.{rule.moe_coarse}"


def map_nextn_checkpoint_name(rule: Mtp, name: str, layer_prefix: str) -> str:
    """A checkpoint name under `layer_prefix` (model.layers.{N}) mapped to the NextN draft's runtime name the way
    a draft class with remap_mtp_names does: spec names -> spec_prefix, the rest -> decoder_prefix."""
    if any(s in name for s in rule.spec_names):
        return name.replace(layer_prefix, rule.spec_prefix, 1)
    return name.replace(layer_prefix, rule.decoder_prefix, 1)


def sglang_mtp_name(sub: str) -> str | None:
    """SGLang's runtime name for MTP sub-module `sub` (e.g. "eh_proj" -> "model.eh_proj",
    "mlp.shared_experts.gate_proj" -> "model.decoder.mlp.shared_experts.gate_proj"); None when SGLang does
    not load it (embed_tokens, shared_head.head come from the target model)."""
    return nextn_name(sglang_mtp_rule(), sub)


def sglang_moe_coarse() -> str:
    return nextn_moe_coarse(sglang_mtp_rule())


# ---- wrapped architectures (VL models) and namespaced MTP heads -----------------------------------------

def architecture(config: dict) -> str:
    archs = config.get("architectures")
    return str(archs[0]) if isinstance(archs, list) and archs else ""


def name_mapper(rules: EngineRules, config: dict) -> dict[str, str]:
    """The engine's checkpoint -> runtime prefix mapping for this config's architecture ({} = same names)."""
    return dict(rules.name_mappers.get(architecture(config)) or {})


def runtime_name(module: str, mapper: dict[str, str]) -> str:
    """The engine's WeightsMapper applied to a module name the way it maps tensor names ("<module>." is mapped, so
    "lm_head" follows the "lm_head." rule): a key starting with "." is an orig_to_new_substr entry (the longest
    one found anywhere in the name, replaced once), applied first; any other key is an orig_to_new_prefix entry."""
    dotted = module + "."
    for old in sorted((k for k in mapper if k.startswith(".")), key=len, reverse=True):
        if old in dotted:
            dotted = dotted.replace(old, mapper[old], 1)
            break
    for old, new in mapper.items():
        if not old.startswith(".") and dotted.startswith(old):
            return (new + dotted[len(old):])[:-1]
    return dotted[:-1]


def build_prefixes(rules: EngineRules, config: dict) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """The engine's (regex, replacement, split replacements) rules for modules this architecture builds under a
    quant-config name other than their checkpoint path (engines.yaml `build_prefixes`; () = none). Never applied
    to `exclude`."""
    return tuple((r.match, r.replace, tuple(r.into)) for r in rules.build_prefixes.get(architecture(config)) or [])


def module_runtime_names(module: str, mapper: dict[str, str],
                         prefixes: tuple[tuple[str, str, tuple[str, ...]], ...] = ()) -> list[str]:
    """The names the engine looks `module` up by: its name mapper, then the build-prefix renames in order; a rule
    with split replacements (`into`) makes one module of each (transformers builds Kimi's fused vision wqkv as
    attn.q_proj, attn.k_proj and attn.v_proj)."""
    names = [runtime_name(module, mapper)]
    for pattern, replacement, into in prefixes:
        if into and any(re.search(pattern, n) for n in names):
            names = [re.sub(pattern, part, n, count=1) for n in names for part in into]
        else:
            names = [re.sub(pattern, replacement, n, count=1) for n in names]
    return names


def module_runtime_name(module: str, mapper: dict[str, str],
                        prefixes: tuple[tuple[str, str, tuple[str, ...]], ...] = ()) -> str | list[str]:
    """`module_runtime_names`, a single name where the engine builds one module."""
    names = module_runtime_names(module, mapper, prefixes)
    return names[0] if len(names) == 1 else names


def mtp_namespace(rules: EngineRules, config: dict) -> MtpNamespace | None:
    """The engine's rule for an MTP head stored under its own namespace (Qwen3.5 `mtp.*`, DeepSeek-V4 `mtp.{k}.*`),
    if this architecture has one."""
    return rules.mtp_namespace.get(architecture(config))


def namespace_draft_name(rule: MtpNamespace, module: str, config: dict) -> str:
    """The name the engine's draft builds namespaced MTP module `module` under (engines.yaml mtp_namespace
    draft_names, applied in order; '{N}' is num_hidden_layers, '{N+k}' that plus the match's group k)."""
    n = int(text_config(config).get("num_hidden_layers") or 0)
    name = module
    for r in rule.draft_names:
        m = re.search(r.match, name)
        if m is None:
            continue
        k = int(m.groupdict().get("k") or 0)
        replacement = r.replace.replace("{N+k}", str(n + k)).replace("{N}", str(n))
        name = name[:m.start()] + m.expand(replacement) + name[m.end():]
    return name


def namespace_layers(rule: MtpNamespace, config: dict) -> list[tuple[int, str]]:
    """(the engine's layer index N+k, the checkpoint prefix it loads) of each declared MTP layer of a namespaced
    head whose engine loads it layer by layer (engines.yaml mtp_namespace layer_prefix); [] otherwise."""
    if not rule.layer_prefix:
        return []
    return [(idx, rule.layer_prefix.replace("{k}", str(k))) for k, idx in enumerate(mtp_layers(config))]


def namespace_aliases(module: str, config: dict) -> list[str]:
    """The draft's names of namespaced MTP module `module` in every engine release whose quant config matches
    exclude against them unmapped (mtp_namespace maps_exclude: false): entries the draft needs besides the
    checkpoint's (vLLM's DeepSeek-V4 draft: mtp.0.attn.wq_a is built as model.layers.{N}.attn.wq_a)."""
    out: list[str] = []
    for engine in engine_names():
        for release in releases(engine):
            rule = mtp_namespace(profile(engine, release).rules, config)
            if rule is None or rule.maps_exclude or not module.startswith(rule.prefix):
                continue
            alias = namespace_draft_name(rule, module, config)
            if alias != module and alias not in out:
                out.append(alias)
    return out


def wrapper_aliases(module: str, config: dict) -> list[str]:
    """Runtime names other engine releases build `module` under (VL wrappers: language_model.model.*, visual.*;
    build prefixes: vLLM's MiniMax-M2 model.layers.N.mlp.* for the checkpoint's block_sparse_moe.*)."""
    out = []
    for mapper, prefixes in _renamers(architecture(config)):
        for alias in module_runtime_names(module, dict(mapper), prefixes):
            if alias != module and alias not in out:
                out.append(alias)
    return out


@lru_cache(maxsize=None)
def _renamers(arch: str) -> tuple:
    """The distinct (name mapper, build prefixes) pairs of every engine release for one architecture. Substring
    entries (keys starting with ".") give no alias: the one release profiled with one (SGLang 0.5.23, MiniMax-M3)
    rewrites `exclude` with that mapper itself (maps_exclude), so the checkpoint name already matches there."""
    config = {"architectures": [arch]}
    pairs = []
    for engine in engine_data()["engines"]:
        for release in releases(engine):
            rules = profile(engine, release).rules
            mapper = {k: v for k, v in name_mapper(rules, config).items() if not k.startswith(".")}
            pair = (tuple(mapper.items()), build_prefixes(rules, config))
            if (pair[0] or pair[1]) and pair not in pairs:
                pairs.append(pair)
    return tuple(pairs)


def unexpanded_fused(rules: EngineRules, config: dict) -> frozenset[str]:
    """Fused modules this architecture builds that the engine's quant config looks up by the fused name only
    (engines.yaml `unexpanded_fused`: the class's packed_modules_mapping lacks them)."""
    return frozenset(rules.unexpanded_fused.get(architecture(config)) or [])


@lru_cache(maxsize=None)
def _unexpanded_shards(arch: str) -> tuple[tuple[str, str], ...]:
    """(shard, fused) pairs over every engine release whose quant config matches `fused` by its own name for
    this architecture."""
    config = {"architectures": [arch]}
    pairs: list[tuple[str, str]] = []
    for engine in engine_data()["engines"]:
        for release in releases(engine):
            rules = profile(engine, release).rules
            packed = rules.packed_modules_mapping
            for fused in sorted(unexpanded_fused(rules, config)):
                pairs += [(shard, fused) for shard in packed.get(fused, []) if (shard, fused) not in pairs]
    return tuple(pairs)


def exclude_aliases(module: str, config: dict) -> list[str]:
    """`_exclude_names`, plus for a shard of a fused module some engine matches by the fused name only (SGLang's
    Glm4MoeForCausalLM qkv_proj) that fused name under each of those spellings. Every shard of the module
    yields it, so it is only honoured when all shards are kept alike (a mixed module fails to build anyway)."""
    names = _exclude_names(module, config)
    fused_of = dict(_unexpanded_shards(architecture(config)))
    if fused_of:
        for name in list(names):
            parent, _, leaf = name.rpartition(".")
            if leaf in fused_of and f"{parent}.{fused_of[leaf]}" not in names:
                names.append(f"{parent}.{fused_of[leaf]}")
    return names


def unexpanded_fused_name(module: str, config: dict) -> str | None:
    """The fused module name some engine looks shard `module` up by (SGLang's Glm4MoeForCausalLM qkv_proj: its
    layer_quant_config keys and exclude entries must name it), or None."""
    fused_of = dict(_unexpanded_shards(architecture(config)))
    parent, _, leaf = module.rpartition(".")
    return f"{parent}.{fused_of[leaf]}" if leaf in fused_of else None


def _exclude_names(module: str, config: dict) -> list[str]:
    """Every exclude entry the engines need for checkpoint module `module`: the name itself first (vLLM,
    transformers and newer SGLang match checkpoint names), then SGLang's runtime names for the MTP layer
    SGLang builds (older SGLang does not remap the draft's exclude list), including the coarse FusedMoE
    prefix for a routed-expert leaf. A coarse `model.layers.{N}.mlp.experts` is deliberately NOT added:
    vLLM before the per-expert MoE fix asserts when an exclude entry matches a FusedMoE prefix."""
    # Wrapped models: the engine's runtime spelling too, so the entry matches whether or not an engine release
    # rewrites `exclude` with its mapper (vllm#54547: none of 1,550 checkpoint-form entries matched).
    names = [module] + wrapper_aliases(module, config) + namespace_aliases(module, config)
    mtp = split_mtp(module, config)
    if mtp is None:
        return names
    index, sub = mtp
    if index != mtp_layers(config).start:  # SGLang builds only the first NextN layer
        return names
    runtime = sglang_mtp_name(sub)
    if runtime is None:
        return names
    names.append(runtime)
    if _EXPERT_LEAF.match(sub):
        names.append(sglang_moe_coarse())
    return names


def map_sglang_mtp_checkpoint_name(name: str, layer_prefix: str) -> str:
    """GlmMoeDsaForCausalLMNextN._map_mtp_ckpt_name: spec names -> model.*, the rest -> model.decoder.*."""
    return map_nextn_checkpoint_name(sglang_mtp_rule(), name, layer_prefix)


def apply_substr_mapper(names: list[str], mapper: dict[str, str], n: int | None = None) -> list[str]:
    """SGLang/vLLM WeightsMapper.orig_to_new_substr applied to a name list (QuarkConfig.apply_weight_name_mapper):
    the longest key found in a name is replaced once (WeightsMapper._map_name, sglang models/utils.py:71-80);
    names are replaced, not duplicated. "{N}" in a key is the MTP layer's index `n` (a draft class whose mapper is
    built from num_hidden_layers: Glm5NextForConditionalGenerationNextN.get_hf_to_sglang_mapper)."""
    rules = sorted(((old.replace("{N}", str(n)), new) for old, new in mapper.items()),
                   key=lambda rule: len(rule[0]), reverse=True)
    out = []
    for name in names:
        for old, new in rules:
            if old in name:
                name = name.replace(old, new, 1)
                break
        out.append(name)
    return list(dict.fromkeys(out))
