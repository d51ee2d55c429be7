"""Model families and recipes: which role each module plays, and which scheme each role gets.

Both are data (`manifests/families/*.yaml`, `manifests/recipes.yaml`); this module only loads and applies them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from quant.checkpoint import text_config
from quant.errors import QuantError
from quant.paths import MANIFESTS_DIR

KEEP = "keep"
BF16 = "bf16"
SCHEME = "scheme"  # the recipe's placeholder for the scheme chosen with --scheme
FP8 = "fp8"


def _load_yaml(path: Path) -> dict:
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise QuantError(f"{path}: file not found") from None
    except yaml.YAMLError as e:
        raise QuantError(f"{path}: invalid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise QuantError(f"{path}: expected a mapping at the top level")
    return data


@dataclass
class Family:
    name: str
    model_types: list[str]
    required_config: list[str]
    roles: dict[str, list[re.Pattern]]  # role -> patterns, in match order ("keep" first)
    mtp: dict | None
    fused_experts: dict | None
    mtp_draft: dict | None = None  # how the engines run the MTP draft (evals/mtp_draft.py)
    # (module regex, (out expression, in expression)) or {model_type: ...}: how engines size each linear (and fused
    # 3-D expert tensor) from config.json
    shapes: list[tuple[re.Pattern, tuple | dict]] = field(default_factory=list)
    # What transformers' decoder layer returns after the hidden states, each fed to the next layer as the keyword
    # argument of that name (quant/gptq/layers.py runs the layers one at a time)
    layer_returns: list[str] = field(default_factory=lambda: ["hidden_states"])

    def role_of(self, module: str) -> str | None:
        for role, patterns in self.roles.items():
            if any(p.search(module) for p in patterns):
                return role
        return None

    def mtp_layers(self, config: dict) -> list[int]:
        """Layer indices holding MTP/NextN layers (model.layers.{N + i})."""
        if not self.mtp:
            return []
        first = config.get(self.mtp["first_layer_key"])
        count = config.get(self.mtp["count_key"]) or 0
        if first is None or not count:
            return []
        return list(range(int(first), int(first) + int(count)))

    def mtp_keep_patterns(self) -> list[re.Pattern]:
        return [re.compile(p) for p in (self.mtp or {}).get("keep", [])]


def _family_file(name: str) -> Path:
    return MANIFESTS_DIR / "families" / f"{name}.yaml"


def load_family(name: str) -> Family:
    data = _load_yaml(_family_file(name))
    parent = load_family(data["inherit"]) if data.get("inherit") else None
    roles: dict[str, list[re.Pattern]] = {KEEP: []}
    if parent:
        for role, patterns in parent.roles.items():
            roles.setdefault(role, []).extend(patterns)
    for role, patterns in (data.get("roles") or {}).items():
        # A family's own patterns go before the inherited ones of the same role.
        roles[role] = [re.compile(p) for p in patterns] + roles.get(role, [])
    return Family(
        name=data["family"],
        model_types=list(data.get("model_types") or []),
        required_config=list(data.get("required_config") or []),
        roles=roles,
        mtp=data.get("mtp", parent.mtp if parent else None),
        fused_experts=data.get("fused_experts", parent.fused_experts if parent else None),
        mtp_draft=data.get("mtp_draft", parent.mtp_draft if parent else None),
        # A family's own formulas go before the inherited ones; a formula is [dims...] or {model_type: [dims...]}
        # (quant/verify/shapes.py picks the config's model_type, else "default").
        shapes=[(re.compile(p), {k: tuple(d) for k, d in v.items()} if isinstance(v, dict) else tuple(v))
                for p, v in (data.get("shapes") or {}).items()]
        + (parent.shapes if parent else []),
        layer_returns=list((data.get("decoder_layer") or {}).get("returns")
                           or (parent.layer_returns if parent else ["hidden_states"])),
    )


def family_for_config(config: dict, config_path: Path | str = "config.json") -> Family:
    cfg = text_config(config)
    model_type = cfg.get("model_type")
    if not model_type:
        raise QuantError(f"{config_path}: missing key 'model_type' (needed to choose the model family)")
    chosen = "generic"
    for path in sorted((MANIFESTS_DIR / "families").glob("*.yaml")):
        if model_type in (_load_yaml(path).get("model_types") or []):
            chosen = path.stem
            break
    family = load_family(chosen)
    for key in family.required_config:
        if key not in cfg:
            raise QuantError(f"{config_path}: missing key '{key}' (the {family.name} recipe needs it)")
    return family


@dataclass
class Recipe:
    name: str
    description: str
    roles: dict[str, str]  # role -> "scheme" | "fp8" | "bf16"
    keep: list[re.Pattern] = field(default_factory=list)  # user-pinned BF16 modules
    mtp_layer: str = "as-main"  # "as-main": MTP layers quantized like the main layers; "bf16": kept whole in BF16

    def treatment(self, role: str | None, module: str) -> str:
        if role in (None, KEEP) or any(p.search(module) for p in self.keep):
            return BF16
        return self.roles.get(role, BF16)

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description, "roles": dict(sorted(self.roles.items())),
                "keep": [p.pattern for p in self.keep], "mtp_layer": self.mtp_layer}


MTP_LAYER_CHOICES = ("as-main", "bf16")


def _recipe_from(data: dict, name: str, where: str) -> Recipe:
    roles = data.get("roles") or {}
    for role, value in roles.items():
        if value not in (SCHEME, FP8, BF16):
            raise QuantError(f"{where}: recipe {name!r} role {role!r} has {value!r}; use scheme, fp8 or bf16")
    try:
        keep = [re.compile(p) for p in data.get("keep") or []]
    except re.error as e:
        raise QuantError(f"{where}: recipe {name!r} has an invalid keep regex ({e})") from None
    mtp_layer = data.get("mtp_layer", "as-main")
    if mtp_layer not in MTP_LAYER_CHOICES:
        raise QuantError(f"{where}: recipe {name!r} has mtp_layer {mtp_layer!r}; use "
                         f"{' or '.join(MTP_LAYER_CHOICES)}")
    return Recipe(name=name, description=data.get("description", ""), roles=dict(roles), keep=keep,
                  mtp_layer=mtp_layer)


def builtin_recipes() -> dict:
    return _load_yaml(MANIFESTS_DIR / "recipes.yaml")


def load_recipe(name_or_path: str | None) -> Recipe:
    """A built-in recipe by name, or a user YAML file `{base: NAME, roles: {...}, keep: [...]}` whose roles
    override the base recipe's."""
    builtin = builtin_recipes()
    recipes = builtin["recipes"]
    name = name_or_path or builtin["default"]
    if name in recipes:
        return _recipe_from(recipes[name], name, str(MANIFESTS_DIR / "recipes.yaml"))
    path = Path(name)
    if path.suffix not in (".yaml", ".yml") and not path.exists():
        raise QuantError(f"unknown recipe {name!r}; built-in recipes: {', '.join(recipes)} (or a YAML file)")
    user = _load_yaml(path)
    base_name = user.get("base", builtin["default"])
    if base_name not in recipes:
        raise QuantError(f"{path}: base recipe {base_name!r} is not one of {', '.join(recipes)}")
    base = _recipe_from(recipes[base_name], base_name, str(MANIFESTS_DIR / "recipes.yaml"))
    override = _recipe_from(user, str(path), str(path))
    return Recipe(name=f"{path.name} (base {base_name})", description=user.get("description", base.description),
                  roles={**base.roles, **override.roles}, keep=base.keep + override.keep,
                  mtp_layer=user.get("mtp_layer", base.mtp_layer))
