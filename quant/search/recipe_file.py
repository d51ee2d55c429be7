"""The search's pick as a user recipe (`quant quantize --recipe`): one anchored `modules` entry per unit; and a
built-in uniform recipe read back as a pick (the reference points beside the Pareto front)."""

from __future__ import annotations

import re

from quant.planning.recipes import load_recipe
from quant.search.searched import Searched


def reference(searched: Searched, recipe: str, family) -> tuple[int, ...] | None:
    """A uniform recipe as a pick (None where one of its unit treatments is off the menu)."""
    r = load_recipe(recipe, family)
    out = []
    for c in searched.choices:
        if c.unit.name in searched.pinned:
            out.append(0)
            continue
        first = c.unit.modules[0]
        want = r.treatment(family.role_of(first), first)
        labels = [o.label for o in c.options]
        if want not in labels:
            return None
        out.append(labels.index(want))
    return tuple(out)


def recipe_yaml(searched: Searched, picks: tuple[int, ...], note: str) -> str:
    """A user recipe (`quant quantize --recipe`): one `modules` entry per unit, anchored on its module names."""
    by_pattern: dict[str, set[str]] = {}  # every module under its name with the expert index as any number
    for c in searched.choices:
        for m in c.unit.modules:
            by_pattern.setdefault(_any_expert(m), set()).add(m)
    lines = [f"# {note}", "base: all-linear", "description: " + note.replace(":", " -"), "modules:"]
    for c, i in zip(searched.choices, picks):
        pattern = unit_pattern(c.unit.modules, by_pattern)
        entry = f"'{pattern}'" if len(pattern) < YAML_KEY_LIMIT else f"? '{pattern}'\n    "  # YAML's explicit key
        lines.append(f"  - {entry}: {c.options[i].label}  # {c.unit.name}")
    return "\n".join(lines) + "\n"


YAML_KEY_LIMIT = 1000  # PyYAML refuses a plain `key: value` key over 1024 characters
EXPERT_INDEX = re.compile(r"\\\.experts\\\.\d+\\\.")  # in an escaped name: \.experts\.12\.


def _any_expert(module: str) -> str:
    """`module` as a regex with its routed-expert index as any number."""
    return EXPERT_INDEX.sub(r"\\.experts\\.\\d+\\.", re.escape(module))


def unit_pattern(modules: tuple[str, ...], by_pattern: dict[str, set[str]]) -> str:
    """A regex matching exactly `modules` among all modules (`by_pattern`: each module under `_any_expert` of its
    name, which a module matches exactly when its own is the same): a layer's routed experts with their index as
    any number where that matches no other module (a recipe a reader can check), else every name spelled out."""
    collapsed = sorted({_any_expert(m) for m in modules})
    if set().union(*(by_pattern.get(p, set()) for p in collapsed)) == set(modules):
        return "^(?:" + "|".join(collapsed) + ")$"
    return "^(?:" + "|".join(re.escape(m) for m in modules) + ")$"
