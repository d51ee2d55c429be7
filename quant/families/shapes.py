"""How the engines size each module from config.json: the family's `shapes:` formulas (arithmetic over the text
config's keys, optionally per model_type) turned into functions of a module name.

Engines allocate every parameter from the config and then copy the stored tensor in (vLLM/SGLang
`create_weights` per TP partition, FusedMoE `w13`/`w2` per expert, transformers `nn.Linear(in, out)`), so the
preflight compares stored tensors with these shapes (quant/verify/shapes.py), not the other way round.
"""

from __future__ import annotations

import re
from typing import Callable

from quant.errors import QuantError
from quant.families import family_for_config, model_types, text_config

# A decoder layer of the language model: model.layers.N (and the VL wrapper's model.language_model.layers.N,
# the runtime language_model.model.layers.N); not a vision tower's layers, not mtp.layers.N.
LM_LAYER = re.compile(r"^(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+)\.")

ShapeOf = Callable[[str], "tuple[int, int] | None"]


def _numbers(config: dict) -> dict[str, int]:
    try:
        adapter = family_for_config(config).adapter  # a release spelling the formulas cannot reach (MiniMax-M3)
    except QuantError:
        adapter = None
    text = text_config(adapter(config) if adapter else config)
    numbers = {k: v for k, v in text.items() if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 40}
    # a list's length sizes modules too (DeepSeek-V4.1's DSpark main_proj reads len(dspark_target_layer_ids))
    numbers.update({f"len_{k}": len(v) for k, v in text.items() if isinstance(v, list) and v})
    return numbers


def evaluate(expression, values: dict[str, int]) -> int | None:
    """A formula of the family data (an int, or arithmetic over the names in `values`) for these values; None
    when it names a key `values` lacks or does not come out a positive int."""
    if isinstance(expression, int):
        return expression
    try:
        # The expressions are the project's own manifest data (arithmetic over config keys); config values only
        # enter as integers, so nothing from a checkpoint is ever evaluated as code.
        result = eval(compile(str(expression), "<shape>", "eval"), {"__builtins__": {}}, values)
    except (NameError, SyntaxError, TypeError, ZeroDivisionError, ValueError, OverflowError):
        return None  # a key this config does not have: no expectation
    return result if isinstance(result, int) and result > 0 else None


def shape_rules(config: dict) -> list[tuple[re.Pattern, tuple, dict]]:
    """(pattern, formula, {layer type: formula}) of the config's family, each formula resolved for the config's
    model_type; the per-layer-type formulas override it for modules of layers of those types."""
    try:
        family = family_for_config(config)
    except QuantError:
        return []
    rules = []
    types = list(reversed(model_types(config)))  # the text model's type first, then the wrapper's
    for pattern, formula in family.shapes:
        by_layer: dict = {}
        if formula is None:  # no expectation for these modules: the text config does not size them
            rules.append((pattern, None, by_layer))
            continue
        if isinstance(formula, dict):
            by_layer = formula.get("layer_types") or {}
            formula = next((formula[t] for t in types if t in formula), formula.get("default"))
            if formula is None:
                continue
        rules.append((pattern, tuple(formula), by_layer))
    return rules


def _resolver(config: dict, dims: int | None) -> Callable[[str], tuple | None]:
    rules = [r for r in shape_rules(config) if r[1] is None or dims is None or len(r[1]) == dims]
    values = _numbers(config)
    layer_types = text_config(config).get("layer_types")
    layer_types = layer_types if isinstance(layer_types, list) else []
    cache: dict[tuple, tuple | None] = {}

    def shape_of(name: str) -> tuple | None:
        for pattern, formula, by_layer in rules:
            if pattern.search(name):
                if formula is None:
                    return None
                if by_layer:
                    layer = LM_LAYER.match(name)
                    index = int(layer.group(1)) if layer else -1
                    if 0 <= index < len(layer_types) and layer_types[index] in by_layer:
                        formula = by_layer[layer_types[index]]
                if formula not in cache:
                    dims_ = tuple(evaluate(e, values) for e in formula)
                    cache[formula] = None if None in dims_ else dims_
                return cache[formula]
        return None

    return shape_of


def config_shapes(config: dict) -> ShapeOf:
    """A function giving the config-implied [out, in] of a checkpoint module (a linear), or None when no rule
    covers it."""
    return _resolver(config, 2)


def tensor_shapes(config: dict) -> Callable[[str], tuple | None]:
    """A function giving the config-implied shape of a stored parameter that is not a linear's `.weight` (the
    fused 3-D experts of BF16 releases), or None."""
    return _resolver(config, 3)
