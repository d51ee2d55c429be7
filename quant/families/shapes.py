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

ShapeOf = Callable[[str], "tuple[int, int] | None"]


def _numbers(config: dict) -> dict[str, int]:
    try:
        adapter = family_for_config(config).adapter  # a release spelling the formulas cannot reach (MiniMax-M3)
    except QuantError:
        adapter = None
    return {k: v for k, v in text_config(adapter(config) if adapter else config).items()
            if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 40}


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


def shape_rules(config: dict) -> list[tuple[re.Pattern, tuple]]:
    """(pattern, formula) of the config's family, each formula resolved for the config's model_type."""
    try:
        family = family_for_config(config)
    except QuantError:
        return []
    rules = []
    types = list(reversed(model_types(config)))  # the text model's type first, then the wrapper's
    for pattern, formula in family.shapes:
        if isinstance(formula, dict):
            formula = next((formula[t] for t in types if t in formula), formula.get("default"))
            if formula is None:
                continue
        rules.append((pattern, tuple(formula)))
    return rules


def _resolver(config: dict, dims: int | None) -> Callable[[str], tuple | None]:
    rules = [(p, f) for p, f in shape_rules(config) if dims is None or len(f) == dims]
    values = _numbers(config)
    cache: dict[tuple, tuple | None] = {}

    def shape_of(name: str) -> tuple | None:
        for pattern, formula in rules:
            if pattern.search(name):
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
