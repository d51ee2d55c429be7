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


def layout_findings(ckpt, shape_of: ShapeOf) -> list:
    """Tensors the engines cannot take whatever the scheme: a weight with a config shape rule that is not a
    non-empty 2-D tensor, and routed experts missing from a MoE layer that config.json sizes for all of them
    (engines allocate every expert and copy each by name; one never copied keeps uninitialised memory)."""
    import re as _re

    from quant.verify.report import Finding

    out = []
    for name, info in sorted(ckpt.tensors.items()):
        if name.endswith(".weight") and shape_of(name[: -len(".weight")]) and \
                (len(info.shape) != 2 or 0 in info.shape):
            out.append(Finding("error", "all", (), name, f"{name} is {info.dtype} {list(info.shape)}, but every "
                               "engine allocates a 2-D weight for it from config.json",
                               "re-export the module as a 2-D weight", "tensor layout"))
    cfg = text_config(ckpt.config)
    experts = next((cfg[k] for k in ("n_routed_experts", "num_experts", "num_local_experts")
                    if isinstance(cfg.get(k), int)), None)
    if not experts:
        return out
    leaf = _re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")
    seen: dict[tuple[str, str], set[int]] = {}
    for name in ckpt.tensors:
        m = leaf.match(name)
        if m:
            seen.setdefault((m.group(1), m.group(3)), set()).add(int(m.group(2)))
    for (coarse, proj), indices in sorted(seen.items()):
        present = sum(1 for i in indices if i < experts)
        if present < experts:
            # Bounded by the tensors present, not by the (possibly huge) declared count.
            missing = [i for i in range(len(indices) + 5) if i not in indices and i < experts][:5]
            out.append(Finding("error", "all", (), f"{coarse}.{missing[0]}.{proj}.weight",
                               f"{coarse} has {present} of the {experts} {proj} experts config.json declares "
                               f"(missing: {', '.join(map(str, missing))}{' ...' if experts - present > 5 else ''}); "
                               "the engines build all of them and leave the missing ones uninitialised",
                               "export every expert", "tensor layout"))
    return out
