"""The [out, in] shape of each linear as the engines size it: from config.json, never from the stored weight.

Engines allocate every parameter from the config (vLLM/SGLang `create_weights`, transformers `nn.Linear`) and
then copy the stored tensor in, so a weight stored in the wrong layout (MXFP4 left unpacked, packed along the
output dimension) is found by comparing it with the shape the config implies, and the finding names the weight
itself. The formulas are model-family data (`shapes:` in manifests/families/*.yaml), evaluated over the
config's language-model keys; a module no formula covers falls back to the shape read back from its weight.
"""

from __future__ import annotations

import re
from typing import Callable

from quant.checkpoint import text_config
from quant.errors import QuantError

ShapeOf = Callable[[str], "tuple[int, int] | None"]


def _numbers(config: dict) -> dict[str, int]:
    return {k: v for k, v in text_config(config).items()
            if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 40}


def _evaluate(expression, values: dict[str, int]) -> int | None:
    if isinstance(expression, int):
        return expression
    try:
        # The expressions are the project's own manifest data (arithmetic over config keys); config values only
        # enter as integers, so nothing from a checkpoint is ever evaluated as code.
        result = eval(compile(str(expression), "<shape>", "eval"), {"__builtins__": {}}, values)
    except (NameError, SyntaxError, TypeError, ZeroDivisionError, ValueError):
        return None  # a key this config does not have: no expectation
    return result if isinstance(result, int) and result > 0 else None


def shape_rules(config: dict) -> list[tuple[re.Pattern, tuple]]:
    from quant.pipeline.recipes import family_for_config

    try:
        family = family_for_config(config)
    except QuantError:
        return []
    return family.shapes


def config_shapes(config: dict) -> ShapeOf:
    """A function giving the config-implied [out, in] of a checkpoint module, or None when no rule covers it."""
    rules = shape_rules(config)
    values = _numbers(config)
    cache: dict[tuple, tuple[int, int] | None] = {}

    def shape_of(module: str) -> tuple[int, int] | None:
        for pattern, (out_expr, in_expr) in rules:
            if pattern.search(module):
                key = (out_expr, in_expr)
                if key not in cache:
                    o, i = _evaluate(out_expr, values), _evaluate(in_expr, values)
                    cache[key] = (o, i) if o and i else None
                return cache[key]
        return None

    return shape_of
