"""Recipes: which scheme each module role gets (the roles themselves are family data, quant/families).

Recipes are data (`manifests/recipes.yaml`, or a user YAML file); this module loads them strictly (an unknown key
is an error naming it, never silently dropped) and applies them. A built-in recipe may be per family
(`per_family: NAME`): its roles then come from the family's `release_recipes.NAME` (AMD's published release of
that family), resolved with `load_recipe(name, family)` or `Recipe.for_family`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from quant.errors import QuantError, did_you_mean
from quant.families import KEEP, BadData, Family, check_keys, family_for_config, family_names, load_family
from quant.families.schema import load_yaml
from quant.paths import MANIFESTS_DIR

__all__ = ["Recipe", "load_recipe", "builtin_recipes", "known_roles", "Family", "family_for_config", "load_family",
           "KEEP", "BF16", "SCHEME", "FP8", "MXFP8", "SECONDARY", "TREATMENTS", "MTP_LAYER_CHOICES"]

BF16 = "bf16"
SCHEME = "scheme"  # the recipe's placeholder for the scheme chosen with --scheme
FP8 = "fp8"
MXFP8 = "mxfp8"  # MXFP8 W8A8 beside the --scheme (quant.planning.schemes.secondary_scheme)
SECONDARY = (FP8, MXFP8)  # role values naming a fixed scheme other than --scheme
MTP_LAYER_CHOICES = ("as-main", "bf16")
RECIPES_FILE = MANIFESTS_DIR / "recipes.yaml"
# The keys of a recipe: built-in ones may be per family, user files name a base recipe.
BUILTIN_RECIPE_KEYS = ("description", "roles", "modules", "keep", "mtp_layer", "per_family")
USER_RECIPE_KEYS = ("base", "description", "roles", "modules", "keep", "mtp_layer")
TREATMENTS = (SCHEME, *SECONDARY, BF16)
RECIPES_FILE_KEYS = ("default", "recipes")


@dataclass
class Recipe:
    name: str
    description: str
    roles: dict[str, str]  # role -> "scheme" | "fp8" | "mxfp8" | "bf16"
    keep: list[re.Pattern] = field(default_factory=list)  # user-pinned BF16 modules
    # Per-module choices, first match wins, before the roles (keep still wins): what `quant search` writes.
    modules: list[tuple[re.Pattern, str]] = field(default_factory=list)
    mtp_layer: str = "as-main"  # "as-main": MTP layers quantized like the main layers; "bf16": kept whole in BF16
    per_family: str | None = None  # the roles are the family's release_recipes[per_family] (unresolved)
    source: str = ""  # the published release it reproduces (per-family recipes)

    def treatment(self, role: str | None, module: str) -> str:
        if self.per_family:
            raise QuantError(f"recipe {self.name!r} is per model family and was not resolved for one "
                             "(load_recipe(name, family))")
        if role in (None, KEEP) or any(p.search(module) for p in self.keep):
            return BF16
        chosen = next((value for pattern, value in self.modules if pattern.search(module)), None)
        return chosen if chosen is not None else self.roles.get(role, BF16)

    def for_family(self, family: Family) -> "Recipe":
        """This recipe for `family`: a per-family recipe takes the family's release_recipes entry; any other
        recipe is returned as it is."""
        if not self.per_family:
            return self
        spec = family.release_recipes.get(self.per_family)
        if spec is None:
            having = [n for n in family_names() if self.per_family in load_family(n).release_recipes]
            raise QuantError(f"recipe {self.name!r}: the {family.name} family has no {self.per_family!r} release "
                             f"recipe (families with one: {', '.join(having)}); add release_recipes."
                             f"{self.per_family} to {family.file}")
        where = f"{family.file}: release_recipes.{self.per_family}"
        own = _recipe_from(spec, self.name, where, allowed=("description", "source", "roles", "keep", "mtp_layer"))
        # A user recipe on a per-family base keeps its own overrides on top of the family's roles.
        return replace(own, name=f"{self.name} ({family.name})", per_family=None,
                       description=spec.get("description") or self.description, source=str(spec.get("source", "")),
                       roles={**own.roles, **self.roles}, keep=own.keep + self.keep, modules=self.modules,
                       mtp_layer=self.mtp_layer if self.mtp_layer != "as-main" else own.mtp_layer)

    def to_dict(self) -> dict:
        out: dict[str, object] = {"name": self.name, "description": self.description,
                                  "roles": dict(sorted(self.roles.items())), "keep": [p.pattern for p in self.keep],
                                  "mtp_layer": self.mtp_layer}
        if self.source:
            out["source"] = self.source
        if self.modules:  # only when given: the plan digest of every recipe without them stays as it was
            out["modules"] = [{p.pattern: value} for p, value in self.modules]
        return out


def known_roles() -> set[str]:
    """Every role some family file defines (a recipe naming another role is a misspelling)."""
    return {role for name in family_names() for role in load_family(name).roles} - {KEEP}


def _recipe_from(data: dict, name: str, where: str, allowed=BUILTIN_RECIPE_KEYS) -> Recipe:
    data = check_keys(data, allowed, where, f"recipe {name!r}")
    roles = data.get("roles") or {}
    if not isinstance(roles, dict):
        raise BadData(f"{where}: recipe {name!r}: roles must be a mapping of role -> scheme|fp8|mxfp8|bf16")
    valid_roles = known_roles()
    for role, value in roles.items():
        if role not in valid_roles:
            check_keys({role: None}, sorted(valid_roles), where, f"recipe {name!r} roles")
        if value not in TREATMENTS:
            raise BadData(f"{where}: recipe {name!r} role {role!r} has {value!r}; use scheme, fp8, mxfp8 or bf16")
    keep_list = data.get("keep") or []
    if not isinstance(keep_list, list) or not all(isinstance(p, str) for p in keep_list):
        raise BadData(f"{where}: recipe {name!r}: keep must be a list of regexes")
    try:
        keep = [re.compile(p) for p in keep_list]
    except re.error as e:
        raise BadData(f"{where}: recipe {name!r} has an invalid keep regex ({e})") from None
    modules = _modules_from(data.get("modules"), name, where)
    mtp_layer = data.get("mtp_layer", "as-main")
    if mtp_layer not in MTP_LAYER_CHOICES:
        raise BadData(f"{where}: recipe {name!r} has mtp_layer {mtp_layer!r}; use "
                      f"{' or '.join(MTP_LAYER_CHOICES)}")
    return Recipe(name=name, description=str(data.get("description", "")), roles=dict(roles), keep=keep,
                  mtp_layer=mtp_layer, per_family=data.get("per_family"), modules=modules)


def _modules_from(value: object, name: str, where: str) -> list[tuple[re.Pattern, str]]:
    """A recipe's `modules`: regex -> treatment in order, as a mapping or as a list of one-entry mappings (a list
    keeps the order in any YAML tool; PyYAML keeps a mapping's order too)."""
    if value is None:
        return []
    items: list = value if isinstance(value, list) else [value]
    if not all(isinstance(item, dict) for item in items):
        raise BadData(f"{where}: recipe {name!r}: modules must map regex -> scheme|fp8|mxfp8|bf16 (a mapping, or a "
                      "list of one-entry mappings)")
    out = []
    for item in items:
        for pattern, treatment in item.items():
            if treatment not in TREATMENTS:
                raise BadData(f"{where}: recipe {name!r} modules {pattern!r} has {treatment!r}; use scheme, fp8, "
                              "mxfp8 or bf16")
            try:
                out.append((re.compile(str(pattern)), treatment))
            except re.error as e:
                raise BadData(f"{where}: recipe {name!r} has an invalid modules regex {pattern!r} ({e})") from None
    return out


def builtin_recipes() -> dict:
    data = check_keys(load_yaml(RECIPES_FILE), RECIPES_FILE_KEYS, str(RECIPES_FILE))
    if not isinstance(data.get("recipes"), dict) or data.get("default") not in data["recipes"]:
        raise BadData(f"{RECIPES_FILE}: needs 'recipes' (a mapping) and a 'default' naming one of them")
    return data


def recipe_names() -> list[str]:
    """The built-in recipes by name, the default first (what `--recipe` help and the README list)."""
    data = builtin_recipes()
    return [data["default"]] + [n for n in data["recipes"] if n != data["default"]]


def load_recipe(name_or_path: str | None, family: Family | None = None) -> Recipe:
    """A built-in recipe by name, or a user YAML file `{base: NAME, roles: {...}, modules: {regex: ...},
    keep: [...], mtp_layer: ...}` whose roles override the base recipe's (its modules come first); resolved for
    `family` when given (per-family recipes need it)."""
    builtin = builtin_recipes()
    recipes = builtin["recipes"]
    name = name_or_path or builtin["default"]
    if name in recipes:
        recipe = _recipe_from(recipes[name], name, str(RECIPES_FILE))
        return recipe.for_family(family) if family is not None else recipe
    path = Path(name)
    if path.suffix not in (".yaml", ".yml") and not path.exists():
        raise BadData(f"unknown recipe {name!r}{did_you_mean(name, recipes)}; built-in recipes: {', '.join(recipes)} "
                      f"(or a YAML file)")
    user = check_keys(load_yaml(path), USER_RECIPE_KEYS, str(path), "the recipe")
    base_name = user.get("base", builtin["default"])
    if base_name not in recipes:
        raise BadData(f"{path}: base recipe {base_name!r} is not one of {', '.join(recipes)}")
    base = _recipe_from(recipes[base_name], base_name, str(RECIPES_FILE))
    if family is not None:
        base = base.for_family(family)
    override = _recipe_from({k: v for k, v in user.items() if k != "base"}, str(path), str(path))
    return Recipe(name=f"{path.name} (base {base_name})", description=user.get("description", base.description),
                  roles={**base.roles, **override.roles}, keep=base.keep + override.keep,
                  modules=override.modules + base.modules, mtp_layer=user.get("mtp_layer", base.mtp_layer),
                  per_family=base.per_family,
                  source=base.source)
