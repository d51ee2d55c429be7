"""Model-family knowledge, in one layer: which family a config.json belongs to, where its text config and its
language model's tensors are, which module plays which role, how the engines size each module, where its MTP
layers live and what an official release of it keeps in BF16.

The knowledge is data (`manifests/families/*.yaml`); this package loads it strictly (an unknown key is an error
naming it) and answers questions about a config. It imports nothing from the rest of the tool but `quant.errors`
and `quant.paths`, so the checkpoint reader, validation, the preflight, the pipeline, GPTQ and the eval stage all
sit above it. Adding a family is one YAML file here (`model_types`, `architectures`, `roles`, `shapes`, `mtp`, ...),
its toy beside it (manifests/toys/<family>.yaml, read by quant.toy) and, only for what data cannot say, a small
adapter in `quant/families/adapters.py`; the
engines' own rules for it (manifests/engines/, keyed by the architecture classes the file names) only where an
engine differs.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable

from quant.errors import QuantError
from quant.families.mtp import MtpLayout, MtpSpec, parse_mtp_spec
from quant.families.schema import BadData, check_keys, load_yaml
from quant.families.sidecars import Sidecar, parse_sidecars
from quant.paths import MANIFESTS_DIR

__all__ = ["Family", "FusedSplit", "BadData", "KEEP", "GENERIC", "MtpLayout", "families_dir", "family_names",
           "load_family", "load_family_file", "family_for_config", "lookup_family", "unknown_family_note",
           "text_config", "model_types", "text_prefix", "mtp_layout"]

KEEP = "keep"
GENERIC = "generic"

# The keys a family file may hold (each read below); anything else is a misspelling.
FAMILY_KEYS = ("family", "inherit", "model_types", "architectures", "required_config", "mtp", "fused_experts",
               "mtp_draft", "roles", "shapes", "decoder_layer", "text_prefixes", "release_recipes", "mtp_unpublished",
               "adapter", "transformers_layer", "bf16_under_schemes", "transformers_since", "sidecars")
DECODER_LAYER_KEYS = ("returns", "carry_bytes_per_token", "workspace_bytes_per_token")
RELEASE_RECIPE_KEYS = ("description", "source", "roles", "keep", "mtp_layer")
TRANSFORMERS_LAYER_KEYS = ("text_model", "renames", "expert_projs", "fused_linears")
NO_TRANSFORMERS_LAYER = {"text_model": None, "renames": {}, "expert_projs": {}, "fused_linears": {}}


def families_dir() -> Path:
    return MANIFESTS_DIR / "families"


def text_config(config: dict) -> dict:
    """A config's language-model fields: vision-language wrappers (Qwen3.5, Kimi-K2.5, MiniMax-M3) keep them under
    text_config; its keys win over the wrapper's."""
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config


def model_types(config: dict) -> list[str]:
    """The config's model types, the wrapper's first, then its text model's (Kimi-K2.5: kimi_k25, kimi_k2)."""
    inner = config.get("text_config")
    types = [config.get("model_type"), inner.get("model_type") if isinstance(inner, dict) else None]
    return list(dict.fromkeys(t for t in types if isinstance(t, str) and t))


@dataclass(frozen=True)
class FusedSplit:
    """How one fused 3-D expert tensor [E, rows, in] splits into per-expert linears: its rows, in order, are
    `parts` (e.g. gate_proj then up_proj of gate_up_proj), each `rows / len(parts)` long."""

    parts: tuple[str, ...]


def _fused_experts(raw: object, where: str) -> dict[str, FusedSplit] | None:
    """The family's `fused_experts` ({param: {split: [...], dim: 1}}), checked; None: the family has none."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise BadData(f"{where}: fused_experts must map a fused parameter to {{split: [...], dim: 1}}")
    out = {}
    for param, spec in raw.items():
        spec = check_keys(spec, ("split", "dim"), where, f"fused_experts.{param}")
        parts = spec.get("split")
        if not isinstance(parts, list) or not parts or not all(isinstance(x, str) for x in parts):
            raise BadData(f"{where}: fused_experts.{param}.split must list the linears its rows hold, in order")
        if spec.get("dim", 1) != 1:  # [E, rows, in]: the rows are what the engines split (w13 / w2)
            raise BadData(f"{where}: fused_experts.{param}.dim must be 1 (the rows of [experts, rows, in])")
        out[param] = FusedSplit(tuple(parts))
    return out


@dataclass
class Family:
    name: str
    model_types: list[str]
    required_config: list[str]
    roles: dict[str, list[re.Pattern]]  # role -> patterns, in match order ("keep" first)
    fused_experts: dict[str, FusedSplit] | None  # fused 3-D expert parameter -> how its rows split
    # Its MTP sections (`mtp`, `mtp_draft`, `mtp_unpublished`), parsed: `mtp_layout` applies them to a config
    mtp: MtpSpec = field(default_factory=MtpSpec)
    # (module regex, (out expression, in expression)) or {model_type: ...}: how engines size each linear (and fused
    # 3-D expert tensor) from config.json
    shapes: list[tuple[re.Pattern, tuple | dict]] = field(default_factory=list)
    # What transformers' decoder layer returns after the hidden states, each fed to the next layer as the keyword
    # argument of that name (quant/model_exec/layers.py runs the layers one at a time)
    layer_returns: list[str] = field(default_factory=lambda: ["hidden_states"])
    # For `quant quantize --dry-run` (quant/gptq/dry_run.py): bytes per calibration token, as expressions over the
    # text config's keys plus seq_len and dtype_bytes (min/max allowed), of what GPTQ holds beside the hidden
    # states: each carried return ({name: expression}), and the largest transient of one decoder layer's forward
    # ("workspace": attention scores and the like, per token of a batch)
    layer_memory: dict = field(default_factory=dict)
    # Tensor-name prefixes of the language model, most specific first ("model.language_model.", ...)
    text_prefixes: list[str] = field(default_factory=lambda: ["model."])
    # Built-in recipes whose content is the family's own (AMD's published release of this family): name -> spec
    release_recipes: dict[str, dict] = field(default_factory=dict)
    # How GPTQ builds the decoder layers with transformers (quant/model_exec/layers.py builds them from config.json and
    # loads them tensor by tensor): `text_model`, the transformers class built for a wrapper AutoModelForCausalLM has
    # no model for, from its text config (a causal LM) or from the whole config when that is the class's own (the
    # wrapper, whose get_decoder() is the text model) (None: AutoModelForCausalLM on config.json); and where the
    # layer keeps a checkpoint tensor when the names differ: `renames` {checkpoint prefix: transformers prefix}
    # within a layer (first match wins), `expert_projs` {checkpoint expert leaf: gate_proj | up_proj | down_proj},
    # `fused_linears` {transformers linear: [checkpoint linears whose rows it concatenates, in order]}
    transformers_layer: dict = field(default_factory=lambda: dict(NO_TRANSFORMERS_LAYER))
    # Modules an engine cannot load in some schemes: {module regex: [scheme names]}; under those schemes they stay
    # BF16 whatever the recipe says (the reason and the engine source sit beside the entry in the family file)
    bf16_under_schemes: list[tuple[re.Pattern, frozenset]] = field(default_factory=list)
    # `adapter: NAME` (quant/families/adapters.py): config.json -> the config the shape formulas are evaluated on
    adapter: Callable[[dict], dict] | None = None
    # The `architectures` of config.json each model type is released with: {model_type: [class, ...]} (the keys
    # engine rules are filed under); never inherited, like model_types
    architectures: dict[str, list[str]] = field(default_factory=dict)
    # The first transformers release whose AutoConfig knows each model type ({model_type: "5.16.1"}; a type no
    # release knows is absent: engines parse it with config classes of their own, engine rules config_registry).
    # An engine release that runs an older transformers and registers no class of its own cannot read config.json
    # (quant/verify/schema.py). Read from transformers' wheels by scripts/release_parsing.py; never inherited.
    transformers_since: dict[str, str] = field(default_factory=dict)
    # What the release ships beside its decoder weights and the engine needs: tables in the shards, a draft file
    # beside them (quant/families/sidecars.py); carried over as stored and checked by the preflight; inherited
    sidecars: list[Sidecar] = field(default_factory=list)
    file: Path | None = None

    def architecture_classes(self) -> list[str]:
        """Every architecture class the family's model types are released with, each once, in file order."""
        return list(dict.fromkeys(c for classes in self.architectures.values() for c in classes))

    def kept_under(self, module: str, scheme: str) -> bool:
        return any(scheme in schemes and pattern.search(module) for pattern, schemes in self.bf16_under_schemes)

    def role_of(self, module: str) -> str | None:
        for role, patterns in self.roles.items():
            if any(p.search(module) for p in patterns):
                return role
        return None

    def text_prefix(self, tensor_names) -> str:
        return text_prefix(tensor_names, self.text_prefixes)


def mtp_layout(config: dict, family: Family | None = None) -> MtpLayout:
    """The MTP layout of a checkpoint with config.json `config` (a wrapper's or its text config) of `family`
    (default: the family its model_type names, the generic one for any other config, with or without a
    model_type: the engines ask about configs the tool would not quantize). The one answer to "which layers are
    MTP layers, and how are they stored" (quant/families/mtp.py)."""
    if family is None:
        # the cached family, not load_family's copy: the engines ask once per module
        family = _load_family_file(families_dir() / f"{lookup_family(config) or GENERIC}.yaml")
    return family.mtp.layout(text_config(config), family.name)


def _compile(pattern: str, where: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise BadData(f"{where}: invalid regex {pattern!r} ({e})") from None


def _patterns(value, where: str) -> list[re.Pattern]:
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise BadData(f"{where}: expected a list of regexes, got {value!r:.60}")
    return [_compile(p, where) for p in value]


@lru_cache(maxsize=None)
def _load_family_file(path: Path) -> Family:
    where = str(path)
    data = check_keys(load_yaml(path), FAMILY_KEYS, where)
    if "family" not in data:
        raise BadData(f"{where}: missing key 'family'")
    if data["family"] != path.stem:
        raise BadData(f"{where}: 'family' is {data['family']!r}; it must be the file name ({path.stem!r})")
    parent = load_family(data["inherit"]) if data.get("inherit") else None
    check_keys(data.get("decoder_layer"), DECODER_LAYER_KEYS, where, "decoder_layer")
    roles = _roles(data.get("roles"), parent, where)
    shapes = _shapes(data.get("shapes"), where)
    recipes = {}  # a release recipe describes one published release: never inherited
    for name, spec in (data.get("release_recipes") or {}).items():
        recipes[name] = dict(check_keys(spec, RELEASE_RECIPE_KEYS, where, f"release_recipes.{name}"))
    adapter = parent.adapter if parent else None
    model_type_list = list(data.get("model_types") or [])
    architectures = _architectures(data.get("architectures"), model_type_list, where)
    if "adapter" in data:
        from quant.families.adapters import ADAPTERS

        if data["adapter"] not in ADAPTERS:
            raise BadData(f"{where}: adapter {data['adapter']!r} is not one of {', '.join(ADAPTERS) or '(none)'}")
        adapter = ADAPTERS[data["adapter"]]
    return Family(
        name=data["family"],
        model_types=model_type_list,
        required_config=list(data.get("required_config") or []),
        roles=roles,
        mtp=parse_mtp_spec(data, parent.mtp if parent else None, where),
        fused_experts=_fused_experts(data["fused_experts"], where) if "fused_experts" in data else
        (parent.fused_experts if parent else None),
        # A family's own formulas go before the inherited ones; a formula is [dims...] or {model_type: [dims...]}
        # (quant/families/shapes.py picks the config's model_type, else "default"; a `layer_types` entry picks by
        # the text config's layer_types entry of the module's layer).
        shapes=shapes + (parent.shapes if parent else []),
        layer_returns=list((data.get("decoder_layer") or {}).get("returns")
                           or (parent.layer_returns if parent else ["hidden_states"])),
        layer_memory={**(parent.layer_memory if parent else {}),
                      **{k: v for k, v in (data.get("decoder_layer") or {}).items() if k != "returns"}},
        text_prefixes=list(data.get("text_prefixes") or (parent.text_prefixes if parent else ["model."])),
        release_recipes=recipes,
        transformers_layer=_transformers_layer(data, parent, where),
        bf16_under_schemes=[(re.compile(p), frozenset(names))
                            for p, names in (data.get("bf16_under_schemes") or {}).items()]
        + (parent.bf16_under_schemes if parent else []),
        adapter=adapter,
        architectures=architectures,
        transformers_since=_transformers_since(data.get("transformers_since"), model_type_list, where),
        sidecars=parse_sidecars(data["sidecars"], where) if "sidecars" in data else
        list(parent.sidecars if parent else []),
        file=path,
    )


def _roles(value, parent: Family | None, where: str) -> dict[str, list[re.Pattern]]:
    """role -> regexes: the family's own patterns before the inherited ones of the same role."""
    roles: dict[str, list[re.Pattern]] = {KEEP: []}
    if parent:
        for role, patterns in parent.roles.items():
            roles.setdefault(role, []).extend(patterns)
    if not isinstance(value or {}, dict):
        raise BadData(f"{where}: roles must be a mapping of role -> regexes")
    for role, patterns in (value or {}).items():
        roles[role] = _patterns(patterns, f"{where}: roles.{role}") + roles.get(role, [])
    return roles


def _shapes(value, where: str) -> list:
    """(regex, formula) pairs of the family's own `shapes`."""
    shapes = []
    for pattern, formula in (value or {}).items():
        if isinstance(formula, dict):
            # {model_type: dims, default: dims, layer_types: {layer type: dims}}: a module name that several
            # layer kinds share (GLM-5.3-Flash's self_attn.o_proj, KDA or MLA) is sized by its layer's type
            formula = {k: ({t: tuple(v) for t, v in d.items()} if k == "layer_types" else tuple(d))
                       for k, d in formula.items()}
        elif isinstance(formula, list):
            formula = tuple(formula)
        elif formula is not None:  # null: modules the text config does not size (a vision tower's)
            raise BadData(f"{where}: shapes[{pattern!r}] must be a list of dimensions, {{model_type: list}} or null")
        shapes.append((_compile(pattern, f"{where}: shapes"), formula))
    return shapes


def _transformers_since(value, model_type_list: list[str], where: str) -> dict[str, str]:
    """`transformers_since: {model_type: "5.16.1"}`: each key one of the file's own model_types."""
    since = value or {}
    if not isinstance(since, dict) or not all(k in model_type_list and isinstance(v, str)
                                              and re.fullmatch(r"\d+(\.\d+)*", v) for k, v in since.items()):
        raise BadData(f"{where}: transformers_since must map the file's own model_types to a transformers release "
                      f"such as \"5.16.1\", got {since!r:.80}")
    return dict(since)


def _architectures(value, model_type_list: list[str], where: str) -> dict[str, list[str]]:
    """`architectures: {model_type: [class, ...]}`: each key one of the file's own model_types, each value a
    non-empty list of class names."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadData(f"{where}: architectures must be a mapping of model_type -> [architecture class, ...]")
    out = {}
    for model_type, classes in value.items():
        if model_type not in model_type_list:
            raise BadData(f"{where}: architectures names model_type {model_type!r}, which is not one of the file's "
                          f"model_types ({', '.join(model_type_list) or 'none'})")
        if not isinstance(classes, list) or not classes or \
                not all(isinstance(c, str) and c.isidentifier() for c in classes):
            raise BadData(f"{where}: architectures.{model_type} must be a non-empty list of class names, "
                          f"got {classes!r:.60}")
        out[model_type] = list(classes)
    return out


def _transformers_layer(data: dict, parent: Family | None, where: str) -> dict:
    if "transformers_layer" not in data:
        return parent.transformers_layer if parent else dict(NO_TRANSFORMERS_LAYER)
    spec = check_keys(data["transformers_layer"], TRANSFORMERS_LAYER_KEYS, where, "transformers_layer")
    renames = spec.get("renames") or {}
    projs = spec.get("expert_projs") or {}
    fused = spec.get("fused_linears") or {}
    text_model = spec.get("text_model")
    if not isinstance(renames, dict) or not isinstance(projs, dict) or \
            not set(projs.values()) <= {"gate_proj", "up_proj", "down_proj"}:
        raise BadData(f"{where}: transformers_layer needs renames {{checkpoint: transformers}} and expert_projs "
                      "{checkpoint leaf: gate_proj | up_proj | down_proj}")
    if not isinstance(fused, dict) or not all(isinstance(v, list) and len(v) > 1 and all(isinstance(x, str) for x in v)
                                              for v in fused.values()):
        raise BadData(f"{where}: transformers_layer.fused_linears needs {{transformers linear: [checkpoint linears, "
                      "...]}} (two or more, in row order)")
    if text_model is not None and not (isinstance(text_model, str) and text_model.isidentifier()):
        raise BadData(f"{where}: transformers_layer.text_model must be a transformers class name, got {text_model!r}")
    return {"text_model": text_model, "renames": {str(k): str(v) for k, v in renames.items()},
            "expert_projs": dict(projs), "fused_linears": {str(k): [str(x) for x in v] for k, v in fused.items()}}


def load_family(name: str) -> Family:
    """The family `name` (a file manifests/families/NAME.yaml), with what it inherits. A fresh copy: callers may
    change it (tests do)."""

    path = families_dir() / f"{name}.yaml"
    if not path.is_file():
        raise BadData(f"{path}: no such model family (known: {', '.join(family_names())})")
    return copy.deepcopy(_load_family_file(path))


def load_family_file(path: Path) -> Family:
    """The family in file `path` (its parents from families_dir()). A fresh copy, as load_family's."""

    return copy.deepcopy(_load_family_file(Path(path)))


def all_families() -> list[Family]:
    """Every family file's Family, by file name (generic included)."""
    return [load_family(name) for name in family_names()]


def family_names() -> list[str]:
    return sorted(p.stem for p in families_dir().glob("*.yaml"))


@lru_cache(maxsize=None)
def _type_table(directory: Path) -> dict[str, str]:
    """model_type -> family name, over every family file; a model_type claimed twice is a data error."""
    table: dict[str, str] = {}
    for path in sorted(directory.glob("*.yaml")):
        for model_type in _load_family_file(path).model_types:
            if model_type in table:
                raise BadData(f"{path}: model_type {model_type!r} is already claimed by {table[model_type]}.yaml")
            table[model_type] = path.stem
    return table


def lookup_family(config: dict) -> str | None:
    """The family name of the config's model type (the wrapper's first, then its text model's); None when no
    family file names it."""
    table = _type_table(families_dir())
    return next((table[t] for t in model_types(config) if t in table), None)


def unknown_family_note(config: dict) -> str | None:
    """One line for a config whose model_type no family file names (None when one does): what the tool then
    does and how to add the family."""
    if lookup_family(config) is not None:
        return None
    types = model_types(config) or ["(none)"]
    return (f"model_type {types[0]!r} has no family data: only name-generic roles and checks apply; add it as "
            f"{families_dir() / (types[0] + '.yaml')} (model_types: [{types[0]}], roles, shapes; see the other "
            "family files)")


def family_for_config(config: dict, config_path: Path | str = "config.json") -> Family:
    """The family of a config (the generic one when no family file names its model_type)."""
    if not model_types(config):
        raise QuantError(f"{config_path}: missing key 'model_type' (needed to choose the model family)")
    family = load_family(lookup_family(config) or GENERIC)
    cfg = text_config(config)
    for key in family.required_config:
        if key not in cfg:
            raise QuantError(f"{config_path}: missing key '{key}' (the {family.name} recipe needs it)")
    return family


def text_prefix(tensor_names, prefixes=None) -> str:
    """Tensor-name prefix of the language model's decoder ("model.", "model.language_model." in Qwen3.5's release,
    "language_model.model." in Kimi-K2.5's): the first of `prefixes` (default: every family's) that some tensor
    name continues with "layers."."""
    if prefixes is None:
        prefixes = all_text_prefixes()
    names = list(tensor_names)
    for prefix in prefixes:
        if any(n.startswith(prefix + "layers.") for n in names):
            return prefix
    return "model."


@lru_cache(maxsize=1)
def all_text_prefixes() -> tuple[str, ...]:
    seen = {p for name in family_names() for p in _load_family_file(families_dir() / f"{name}.yaml").text_prefixes}
    return tuple(sorted(seen, key=lambda p: (-len(p), p)))
