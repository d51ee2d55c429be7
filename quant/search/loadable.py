"""The pick the engines load: each pick previewed by the preflight before it is returned (the export it would
write, read from its plan by quant.pipeline.preview and checked by verify-manifest's own code)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

from quant.checkpoint import Checkpoint
from quant.errors import QuantError
from quant.families import family_for_config
from quant.pipeline.preview import preview_checkpoint
from quant.planning.plan import make_plan
from quant.planning.recipes import load_recipe
from quant.planning.schemes import DEFAULT_SCHEME, get_scheme
from quant.search.recipe_file import recipe_yaml
from quant.search.searched import Searched, pick
from quant.verify import verify_checkpoint


def preview_errors(ckpt: Checkpoint, searched: Searched, picks: tuple[int, ...], engines: list[str] | None,
                   scale_mode: str) -> list:
    """verify-manifest's errors for the export `quant quantize SRC OUT --recipe` would write from the open source
    `ckpt` for `picks`, read from that export's headers and config.json as planned (quant.pipeline.preview),
    nothing written."""
    family = family_for_config(ckpt.config)
    with tempfile.TemporaryDirectory(prefix="quant-search-") as tmp:
        path = Path(tmp) / "recipe.yaml"
        path.write_text(recipe_yaml(searched, picks, "preview"))
        plan = make_plan(ckpt, family, load_recipe(str(path), family), get_scheme(DEFAULT_SCHEME), scale_mode)
    return verify_checkpoint(preview_checkpoint(plan, ckpt), engines=engines).errors


def loadable_pick(ckpt: Checkpoint, searched: Searched, engines: list[str] | None, max_size: int | None,
                  bits: float | None, scale_mode: str, log: Callable[[str], None]) -> tuple[int, ...] | None:
    """The pick, previewed by the preflight: a (unit, treatment) the preflight blames is taken off the menu and
    the budget solved again, until the preview passes. The menus already hold only what the engine rules load
    (menu.py); this catches what only the whole export shows. A failure no unit's choice causes is one line."""
    unit_of = {m: k for k, c in enumerate(searched.choices) for m in c.unit.modules}
    banned: frozenset[tuple[int, str]] = frozenset()
    for _ in range(sum(len(c.options) for c in searched.choices)):
        picks = pick(searched, max_size, bits, banned)
        if picks is None:
            return None
        errors = preview_errors(ckpt, searched, picks, engines, scale_mode)
        if not errors:
            return picks
        blamed = set()
        for finding in errors:
            k = _unit_of_tensor(finding.tensor, unit_of)
            if k is None:
                raise QuantError(f"{finding.engine} {'/'.join(finding.versions)}: {finding.message}; no choice the "
                                 f"search makes changes this (fix: {finding.fix})")
            blamed.add((k, searched.choices[k].options[picks[k]].label))
        for k, label in sorted(blamed):
            log(f"  {searched.choices[k].unit.name}: {label} taken off the menu (the preflight of the pick refuses it)")
        banned = banned | blamed
    return None


def _unit_of_tensor(tensor: str, unit_of: dict[str, int]) -> int | None:
    name = tensor
    while name:
        if name in unit_of:
            return unit_of[name]
        name = name.rpartition(".")[0]
    return None
