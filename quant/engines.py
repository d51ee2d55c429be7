"""Engine profiles (SGLang, vLLM, transformers) read from manifests/engines/ (one file per release,
quant/engine_files.py), and the names each engine gives a checkpoint module when it looks up its quantization scheme.

A `Profile` is one engine release with its rules merged (engine-wide rules overridden by the release's), typed
by the schema in quant/engine_rules.py (an unknown or misspelled key in a rule file is an error when it is read).
Its methods answer what that release does with a checkpoint: the names it builds a module under (`renamer`), the
`exclude` and `layer_quant_config` its quant config matches them against, the names its MTP draft builds
(`mtp_draft_name`, `namespace_draft_name`) and the exclude entries that draft needs (`draft_exclude_names`).
`exclude_aliases` asks every profile for the exclude entries one checkpoint module needs; the quantizer uses it to
write `exclude`, verify-manifest uses the same profiles to predict load failures. Nothing here names an engine:
what differs between engines is a rule key of the engine files (tests/test_architecture.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from quant.engine_files import EngineFiles, read_engines
from quant.engine_rules import DraftClass, EngineRules, MtpNamespace, StrayTensor
from quant.families import mtp_layout
from quant.errors import QuantError, did_you_mean
from quant.paths import MANIFESTS_DIR

# Read when first asked (engine_files), so a test or the profile checker can point it at another copy.
ENGINES_DIR = MANIFESTS_DIR / "engines"
# A decoder layer's module (model.layers.N.*, a VL wrapper's model.language_model.layers.N.* or
# language_model.model.layers.N.*): (layer prefix, index, module within the layer).
_LAYER = re.compile(r"^((?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+))\.(.+)$")
_EXPERT_LEAF = re.compile(r"^mlp\.experts\.\d+\.")


@lru_cache(maxsize=1)
def engine_files() -> dict[str, EngineFiles]:
    """Every engine's rule files under ENGINES_DIR, read and checked once."""
    return read_engines(ENGINES_DIR)


def architecture(config: dict) -> str:
    archs = config.get("architectures")
    return str(archs[0]) if isinstance(archs, list) and archs else ""


# ---- MTP layers of a config -----------------------------------------------------------------------------

def mtp_layers(config: dict) -> range:
    """Checkpoint layer indices of the MTP/NextN layers an engine's draft looks for in the decoder stack
    (model.layers.{N + k}): the config's MTP layout's `nextn_layers` (quant/families/mtp.py)."""
    return mtp_layout(config).nextn_layers


def mtp_count_key(config: dict) -> str:
    """The config.json key declaring the MTP layers, for the findings that name it."""
    return mtp_layout(config).count_key


def layer_index(module: str) -> int | None:
    m = _LAYER.match(module)
    return int(m.group(2)) if m else None


def split_mtp(module: str, config: dict) -> tuple[int, str] | None:
    """(layer index, sub-module name) when `module` lies in a declared MTP layer, else None."""
    m = _LAYER.match(module)
    if m and int(m.group(2)) in mtp_layers(config):
        return int(m.group(2)), m.group(3)
    return None


# ---- name mapping ---------------------------------------------------------------------------------------

Prefixes = tuple[tuple[str, str, tuple[str, ...]], ...]  # (regex, replacement, split replacements)


@dataclass(frozen=True)
class NameMapper:
    """A model class's WeightsMapper (WeightsMapper._map_name, sglang models/utils.py:71-80; vLLM's alike):
    `substr` (orig_to_new_substr: the longest key found anywhere in the name, replaced once) first, then `prefix`
    (orig_to_new_prefix: the first key the name starts with). A module name is mapped the way its tensor names
    are, as "<module>." (so "lm_head" follows an "lm_head." rule). The one implementation of name mapping: the
    model classes' mappers (engine rules name_mappers) and the draft classes' exclude mappers both go through it."""

    substr: tuple[tuple[str, str], ...] = ()
    prefix: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, mapping: dict[str, str]) -> NameMapper:
        """engine rules `name_mappers` spelling: a key starting with "." is a substring entry, any other a prefix."""
        return cls(_longest_first((k, v) for k, v in mapping.items() if k.startswith(".")),
                   tuple((k, v) for k, v in mapping.items() if not k.startswith(".")))

    @classmethod
    def substrings(cls, mapping: dict[str, str], n: int) -> NameMapper:
        """A draft class's `exclude_mapper` (QuarkConfig.apply_weight_name_mapper): every key a substring entry,
        "{N}" in it the MTP layer's index `n` (a mapper built from num_hidden_layers:
        Glm5NextForConditionalGenerationNextN.get_hf_to_sglang_mapper)."""
        return cls(_longest_first((k.replace("{N}", str(n)), v) for k, v in mapping.items()))

    def __bool__(self) -> bool:
        return bool(self.substr or self.prefix)

    def __call__(self, name: str) -> str:
        dotted = name + "."
        for old, new in self.substr:
            if old in dotted:
                dotted = dotted.replace(old, new, 1)
                break
        for old, new in self.prefix:
            if dotted.startswith(old):
                return (new + dotted[len(old):])[:-1]
        return dotted[:-1]

    def prefixes_only(self) -> NameMapper:
        return NameMapper(prefix=self.prefix)


def _longest_first(items) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(items, key=lambda item: len(item[0]), reverse=True))


@dataclass(frozen=True)
class Renamer:
    """The names an engine release builds a checkpoint module under: its name mapper, then its build-prefix renames
    in order (engine rules `build_prefixes`, never applied to `exclude`); a rule with split replacements (`into`)
    makes one module of each (transformers builds Kimi's fused vision wqkv as attn.q_proj, attn.k_proj and
    attn.v_proj)."""

    mapper: NameMapper = NameMapper()
    prefixes: Prefixes = ()

    def names(self, module: str) -> list[str]:
        names = [self.mapper(module)]
        for pattern, replacement, into in self.prefixes:
            if into and any(re.search(pattern, n) for n in names):
                names = [re.sub(pattern, part, n, count=1) for n in names for part in into]
            else:
                names = [re.sub(pattern, replacement, n, count=1) for n in names]
        return names

    def name(self, module: str) -> str | list[str]:
        """`names`, a single name where the engine builds one module."""
        names = self.names(module)
        return names[0] if len(names) == 1 else names


def runtime_name(module: str, mapper: dict[str, str]) -> str:
    """`module` under a mapper in the engine files' spelling (NameMapper.of)."""
    return NameMapper.of(mapper)(module)


def name_mapper(rules: EngineRules, config: dict) -> dict[str, str]:
    """The engine's checkpoint -> runtime mapper for this config's architecture, as the engine files spell it ({} = same
    names)."""
    return dict(rules.name_mappers.get(architecture(config)) or {})


def build_prefixes(rules: EngineRules, config: dict) -> Prefixes:
    """The engine's build-prefix renames for this config's architecture (engine rules `build_prefixes`; () = none)."""
    return tuple((r.match, r.replace, tuple(r.into)) for r in rules.build_prefixes.get(architecture(config)) or [])


# ---- namespaced MTP heads (Qwen3.5 `mtp.*`, DeepSeek-V4 `mtp.{k}.*`) ---------------------------------------

def mtp_namespace(rules: EngineRules, config: dict) -> MtpNamespace | None:
    """The engine's rule for an MTP head stored under its own namespace, if this architecture has one."""
    return rules.mtp_namespace.get(architecture(config))


def namespace_draft_name(rule: MtpNamespace, module: str, config: dict) -> str:
    """The name the engine's draft builds namespaced MTP module `module` under (engine rules mtp_namespace
    draft_names, applied in order; '{N}' is num_hidden_layers, '{N+k}' that plus the match's group k)."""
    n = mtp_layout(config).first
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
    head whose engine loads it layer by layer (engine rules mtp_namespace layer_prefix); [] otherwise."""
    if not rule.layer_prefix:
        return []
    return [(idx, rule.layer_prefix.replace("{k}", str(k))) for k, idx in enumerate(mtp_layout(config).published)]


# ---- one engine release ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Profile:
    """One engine release: `rules` are the engine-wide rules with the release's overrides applied; its methods
    answer the release's questions about one checkpoint (`config` is its config.json)."""

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

    # -- reading config.json

    def parses(self, model_type: str, since: str) -> bool:
        """Whether this release reads a config.json of `model_type`, which transformers knows from release `since`:
        a config class of its own, or a transformers its requirement admits that is `since` or newer."""
        if model_type in self.rules.config_registry or self.rules.transformers is None:
            return True
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version

        spec = SpecifierSet(self.rules.transformers)
        candidates = [Version(since)] + [Version(s.version) for s in spec]
        return any(v >= Version(since) and v in spec for v in candidates)

    def first_release_parsing(self, model_type: str, since: str) -> str | None:
        """The label of this engine's first profiled release that reads `model_type` (None: none does)."""
        return next((p.label for p in (profile(self.engine, r) for r in releases(self.engine))
                     if p.parses(model_type, since)), None)

    # -- the target model

    def renamer(self, config: dict) -> Renamer:
        """How this release names the checkpoint's modules (name mapper, then build prefixes)."""
        return Renamer(NameMapper.of(name_mapper(self.rules, config)), build_prefixes(self.rules, config))

    def never_quantized(self, config: dict) -> list[str]:
        """Regexes of modules this release builds without asking the quant config, for this architecture."""
        return self.rules.never_quantized + self.rules.never_quantized_by_architecture.get(architecture(config), [])

    def unexpanded_fused(self, config: dict) -> frozenset[str]:
        """Fused modules this architecture builds that the quant config looks up by the fused name only
        (engine rules `unexpanded_fused`: the class's packed_modules_mapping lacks them)."""
        return frozenset(self.rules.unexpanded_fused.get(architecture(config)) or [])

    def stray_tensor(self, tensor: str, config: dict) -> StrayTensor | None:
        """How this release's loader treats `tensor`, which its module as built has no parameter for: the first
        stray_tensors entry of the architecture matching it (None: not recorded, taken as rejected)."""
        for entry in self.rules.stray_tensors.get(architecture(config)) or []:
            if re.search(entry.match, tensor):
                return entry
        return None

    def quant_config_exclude(self, exclude: list[str], config: dict) -> list[str]:
        """The exclude entries the quant config matches against runtime names: rewritten with the name mapper
        where the release does so (maps_exclude; `re:` entries are not rewritten), each mapped entry starting with
        an exclude_prefix_aliases prefix kept beside its copy without it."""
        mapper = NameMapper.of(name_mapper(self.rules, config))
        if not (mapper and self.rules.maps_exclude):
            return exclude
        out = [e if e.startswith("re:") else mapper(e) for e in exclude]
        for strip in self.rules.exclude_prefix_aliases:
            out = list(dict.fromkeys(x for e in out for x in (e, e.removeprefix(strip) if e.startswith(strip) else e)))
        return out

    def quant_config_layer_config(self, lqc: dict, config: dict) -> dict:
        """layer_quant_config as the quant config matches it: keys rewritten with the name mapper where the release
        does so (maps_layer_quant_config)."""
        mapper = NameMapper.of(name_mapper(self.rules, config))
        if not (mapper and self.rules.maps_layer_quant_config):
            return lqc
        return {mapper(k): v for k, v in lqc.items()}

    # -- the MTP draft

    def mtp_namespace(self, config: dict) -> MtpNamespace | None:
        return mtp_namespace(self.rules, config)

    def namespace_draft_name(self, module: str, config: dict) -> str:
        """The name this release's draft builds namespaced MTP module `module` under (`module` without a rule)."""
        rule = self.mtp_namespace(config)
        return module if rule is None else namespace_draft_name(rule, module, config)

    def namespace_layers(self, config: dict) -> list[tuple[int, str]]:
        rule = self.mtp_namespace(config)
        return [] if rule is None else namespace_layers(rule, config)

    def draft_layers(self, config: dict) -> range:
        """The declared MTP layers this release's draft loads (mtp.draft_layers)."""
        layers = mtp_layers(config)
        return layers[:1] if self.rules.mtp.draft_layers == "first" else layers

    def mtp_draft_name(self, module: str, config: dict) -> str | None:
        """The name this release's draft builds checkpoint module `module` under: the NextN runtime name
        (mtp.draft_naming: nextn; "eh_proj" -> "model.eh_proj", "mlp.shared_experts.gate_proj" ->
        "model.decoder.mlp.shared_experts.gate_proj") or the checkpoint's, renamed where the architecture's draft
        builds it under another name (mtp.draft_names); None when the draft does not load it
        (not in a layer it loads, or a skipped module: embed_tokens and shared_head.head come from the target)."""
        mtp = split_mtp(module, config)
        if mtp is None or mtp[0] not in self.draft_layers(config):
            return None
        rule = self.rules.mtp
        sub = mtp[1]
        if rule.draft_naming == "checkpoint":
            return self.draft_renamer(config).name(module)
        if any(s in sub for s in rule.skip):
            return None
        if any(s in sub for s in rule.spec_names):
            return f"{rule.spec_prefix}.{sub}"
        return f"{rule.decoder_prefix}.{sub}"

    def draft_renamer(self, config: dict) -> Renamer:
        """How a checkpoint-named draft renames its MTP layers' modules for this architecture (mtp.draft_names;
        Renamer() = the checkpoint's names)."""
        rules = self.rules.mtp.draft_names.get(architecture(config)) or []
        return Renamer(prefixes=tuple((r.match, r.replace, ()) for r in rules))  # one module each (no `into`)

    def draft_moe_coarse(self) -> str:
        """The NextN draft's FusedMoE prefix (decoder_prefix.moe_coarse)."""
        return f"{self.rules.mtp.decoder_prefix}.{self.rules.mtp.moe_coarse}"

    def nextn_checkpoint_name(self, name: str, layer_prefix: str) -> str:
        """A checkpoint name under `layer_prefix` (model.layers.{N}) mapped to the NextN draft's runtime name the way
        a draft class with remap_mtp_names does (GlmMoeDsaForCausalLMNextN._map_mtp_ckpt_name): spec names ->
        spec_prefix, the rest -> decoder_prefix."""
        rule = self.rules.mtp
        if any(s in name for s in rule.spec_names):
            return name.replace(layer_prefix, rule.spec_prefix, 1)
        return name.replace(layer_prefix, rule.decoder_prefix, 1)

    def draft_class(self, config: dict) -> tuple[str, DraftClass]:
        """(name, rules) of the NextN draft class this release builds for the config's architecture."""
        rule = self.rules.mtp
        name = rule.draft_class.get(architecture(config), rule.default_draft_class)
        return name, rule.draft_classes[name]

    def draft_exclude_mapper(self, config: dict) -> NameMapper:
        """The mapper the draft class's loader applies to `exclude` (mtp.draft_classes exclude_mapper)."""
        return NameMapper.substrings(self.draft_class(config)[1].exclude_mapper, mtp_layout(config).first)

    def draft_exclude_names(self, module: str, config: dict) -> list[str]:
        """Exclude entries this release's draft needs for checkpoint module `module` besides its checkpoint name
        (mtp.exclude_runtime_names, mtp.exclude_moe_coarse)."""
        rule = self.rules.mtp
        name = self.mtp_draft_name(module, config) if rule.exclude_runtime_names else None
        if name is None or name == module:
            return []
        if rule.exclude_moe_coarse and _EXPERT_LEAF.match(split_mtp(module, config)[1]):
            return [name, self.draft_moe_coarse()]
        return [name]


# ---- the profiles ---------------------------------------------------------------------------------------

def releases(engine: str) -> list[str]:
    """The engine's profiled releases, oldest first."""
    return list(_engine(engine).releases)


def _engine(engine: str) -> EngineFiles:
    engines = engine_files()
    if engine not in engines:
        raise QuantError(f"unknown engine '{engine}'{did_you_mean(engine, engines)} (known: {', '.join(engines)})")
    return engines[engine]


@lru_cache(maxsize=None)
def profile(engine: str, release: str) -> Profile:
    files = _engine(engine)
    if release not in files.releases:
        raise QuantError(f"unknown {engine} release '{release}' (profiles exist for: "
                         f"{', '.join(files.releases)}; see {files.path.parent})")
    return Profile(engine, release, files.title, files.rules(release))


def engine_names() -> list[str]:
    """The engines profiled, in index.yaml's order."""
    return list(engine_files())


@lru_cache(maxsize=1)
def all_profiles() -> tuple[Profile, ...]:
    """Every release of every engine, engines in index.yaml's order, releases oldest first (questions about all
    engines ask each of them)."""
    return tuple(profile(engine, release) for engine in engine_names() for release in releases(engine))


def serving_engines() -> tuple[str, ...]:
    """What a preflight checks when no engine is named: the engines that serve a checkpoint (engine.yaml
    `serving`)."""
    return tuple(name for name, files in engine_files().items() if files.serving)


def select_profiles(specs: list[str] | None) -> list[Profile]:
    """Profiles for engine specs: "all", "sglang" (its default releases), "sglang==0.5.12" or
    "sglang==latest" (the newest release profiled); none: the serving engines (serving_engines)."""
    out: list[Profile] = []
    for spec in specs or list(serving_engines()):
        for item in str(spec).split(","):
            item = item.strip()
            if not item:
                continue
            if item == "all":
                names = [(e, None) for e in engine_files()]
            elif "==" in item:
                engine, release = item.split("==", 1)
                names = [(engine.strip(), release.strip())]
            else:
                names = [(item, None)]
            for engine, release in names:
                if release == "latest":
                    release = releases(engine)[-1]
                chosen = [release] if release else list(_engine(engine).default_releases) or releases(engine)
                for r in chosen:
                    p = profile(engine, r)
                    if p not in out:
                        out.append(p)
    if not out:
        raise QuantError(f"no engine selected (use {', '.join(engine_names())} or all)")
    return out


def named_releases(specs: list[str] | None) -> set[str]:
    """The labels of the releases `specs` name one by one ("sglang==0.5.12", "vllm==latest"), as opposed to
    those an engine name or "all" stands for."""
    out = set()
    for spec in specs or []:
        for item in str(spec).split(","):
            if "==" in item:
                out |= {p.label for p in select_profiles([item.strip()])}
    return out


def newest(profile_: Profile) -> bool:
    """Whether this is its engine's newest profiled release (an export must load there: the self-check's rule)."""
    return profile_.release == releases(profile_.engine)[-1]


# ---- questions about every engine -----------------------------------------------------------------------

def mtp_namespace_prefix(config: dict) -> str | None:
    """The namespace MTP heads of this architecture live under for any engine (Qwen3.5: "mtp.")."""
    for p in all_profiles():
        rule = p.mtp_namespace(config)
        if rule is not None:
            return rule.prefix
    return None


def namespace_aliases(module: str, config: dict) -> list[str]:
    """The draft's names of namespaced MTP module `module` in every engine release whose quant config matches
    exclude against them unmapped (mtp_namespace maps_exclude: false): entries the draft needs besides the
    checkpoint's (vLLM's DeepSeek-V4 draft: mtp.0.attn.wq_a is built as model.layers.{N}.attn.wq_a)."""
    out: list[str] = []
    for p in all_profiles():
        rule = p.mtp_namespace(config)
        if rule is None or rule.maps_exclude or not module.startswith(rule.prefix):
            continue
        alias = p.namespace_draft_name(module, config)
        if alias != module and alias not in out:
            out.append(alias)
    return out


def wrapper_aliases(module: str, config: dict) -> list[str]:
    """Runtime names other engine releases build `module` under (VL wrappers: language_model.model.*, visual.*;
    build prefixes: vLLM's MiniMax-M2 model.layers.N.mlp.* for the checkpoint's block_sparse_moe.*)."""
    out = []
    for renamer in _renamers(architecture(config)):
        for alias in renamer.names(module):
            if alias != module and alias not in out:
                out.append(alias)
    return out


@lru_cache(maxsize=None)
def _renamers(arch: str) -> tuple[Renamer, ...]:
    """The distinct renamers (prefix entries of the name mapper, build prefixes) of every engine release for one
    architecture. Substring entries (keys starting with ".") give no alias: the one release profiled with one
    (SGLang 0.5.23, MiniMax-M3) rewrites `exclude` with that mapper itself (maps_exclude), so the checkpoint name
    already matches there."""
    config = {"architectures": [arch]}
    out: list[Renamer] = []
    for p in all_profiles():
        full = p.renamer(config)
        renamer = Renamer(full.mapper.prefixes_only(), full.prefixes)
        if (renamer.mapper or renamer.prefixes) and renamer not in out:
            out.append(renamer)
    return tuple(out)


def draft_aliases(module: str, config: dict) -> list[str]:
    """The exclude entries every engine release's MTP draft needs for `module` besides its checkpoint name
    (Profile.draft_exclude_names)."""
    if split_mtp(module, config) is None:
        return []
    out: list[str] = []
    for p in all_profiles():
        out += [name for name in p.draft_exclude_names(module, config) if name not in out]
    return out


@lru_cache(maxsize=None)
def _unexpanded_shards(arch: str) -> tuple[tuple[str, str], ...]:
    """(shard, fused) pairs over every engine release whose quant config matches `fused` by its own name for
    this architecture."""
    config = {"architectures": [arch]}
    pairs: list[tuple[str, str]] = []
    for p in all_profiles():
        packed = p.rules.packed_modules_mapping
        for fused in sorted(p.unexpanded_fused(config)):
            pairs += [(shard, fused) for shard in packed.get(fused, []) if (shard, fused) not in pairs]
    return tuple(pairs)


def exclude_aliases(module: str, config: dict) -> list[str]:
    """Every exclude entry the engines need for checkpoint module `module`: the name itself first, then the
    runtime names other releases build it under (wrapper_aliases: wrapped models, so the entry matches whether or
    not a release rewrites `exclude` with its mapper, vllm#54547: none of 1,550 checkpoint-form entries matched;
    namespace_aliases; draft_aliases: the MTP draft's own names). For a shard of a fused module some engine matches
    by the fused name only (SGLang's Glm4MoeForCausalLM qkv_proj) that fused name under each of those spellings:
    every shard of the module yields it, so it is only honoured when all shards are kept alike (a mixed module
    fails to build anyway)."""
    names = [module] + wrapper_aliases(module, config) + namespace_aliases(module, config)
    names += [name for name in draft_aliases(module, config) if name not in names]
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
