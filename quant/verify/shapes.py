"""The shape of every parameter as the engines size it: from config.json, never from the stored tensor.

Engines allocate every parameter from the config and then copy the stored tensor in (vLLM/SGLang
`create_weights` per TP partition, FusedMoE `w13`/`w2` per expert, transformers `nn.Linear(in, out)`), so a
tensor stored in the wrong layout (MXFP4 left unpacked, packed along the output dimension, a scale grid of the
wrong size) is found by comparing it with the shape the config implies, and the finding names the tensor that
differs. The [out, in] formulas of each linear are model-family data (`shapes:` in manifests/families/*.yaml,
arithmetic over the text config's keys, optionally per model_type); the stored-tensor shape of each scheme
(packed MXFP4, E8M0 scales, block-FP8 grids) is derived from them in quant/verify/contract.py and block_fp8.py.
A module no formula covers falls back to the shape read back from its weight (contract.logical_shape).
"""

from __future__ import annotations

import math
import re
from typing import Callable

from quant.checkpoint import text_config
from quant.errors import QuantError

ShapeOf = Callable[[str], "tuple[int, int] | None"]

# Block-FP8 checkpoints (quant_method "fp8", weight_block_size [128, 128]): one F32 weight_scale_inv per 128x128
# tile, partial tiles at the ends (vLLM fp8_utils.py create_fp8_scale_parameter / SGLang fp8.py
# Fp8LinearMethod.create_fp8_weight_: [ceil(out/128), ceil(in/128)]).
FP8_BLOCK = 128
# OCP MX: two E2M1 codes per byte along the input dimension, one E8M0 scale byte per 32 inputs (vLLM
# quark_ocp_mx.py QuarkOCP_MX.create_weights / quark_moe.py QuarkOCP_MX_MoEMethod.create_weights; SGLang
# quark_w4a4_mxfp4.py QuarkW4A4MXFP4.create_weights: weight U8 [out, in // 2], weight_scale U8 [out, in // 32]).
MX_GROUP = 32
MX_PACK = 2


def block_grid(shape: tuple[int, int], block: int = FP8_BLOCK) -> tuple[int, int]:
    """The [ceil(out/block), ceil(in/block)] weight_scale_inv grid of a block-FP8 linear."""
    return math.ceil(shape[0] / block), math.ceil(shape[1] / block)


def mx_weight(shape: tuple[int, int]) -> tuple[int, int]:
    """The packed U8 MXFP4 weight of a linear of logical [out, in]."""
    return shape[0], shape[1] // MX_PACK


def mx_scale(shape: tuple[int, int]) -> tuple[int, int]:
    """The U8 (E8M0) MXFP4 scale of a linear of logical [out, in]."""
    return shape[0], shape[1] // MX_GROUP


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
    except (NameError, SyntaxError, TypeError, ZeroDivisionError, ValueError, OverflowError):
        return None  # a key this config does not have: no expectation
    return result if isinstance(result, int) and result > 0 else None


def _model_types(config: dict) -> list[str]:
    types = [text_config(config).get("model_type"), config.get("model_type")]
    return [t for t in types if isinstance(t, str)]


def shape_rules(config: dict) -> list[tuple[re.Pattern, tuple]]:
    """(pattern, formula) of the config's family, each formula resolved for the config's model_type."""
    from quant.pipeline.recipes import family_for_config

    try:
        family = family_for_config(config)
    except QuantError:
        return []
    rules = []
    types = _model_types(config)
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
                    dims_ = tuple(_evaluate(e, values) for e in formula)
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


def layout_findings(ckpt, shape_of: ShapeOf) -> list:
    """Tensors the engines cannot take whatever the scheme: a weight with a config shape rule that is not a
    non-empty 2-D tensor, a fused 3-D expert tensor of another shape than config.json sizes, and routed experts
    missing from a MoE layer that config.json sizes for all of them (engines allocate every expert and copy each
    by name; one never copied keeps uninitialised memory)."""
    import re as _re

    from quant.verify.report import Finding

    out = []
    fused_shape = tensor_shapes(ckpt.config)
    for name, info in sorted(ckpt.tensors.items()):
        if name.endswith(".weight") and shape_of(name[: -len(".weight")]) and \
                (len(info.shape) != 2 or 0 in info.shape):
            out.append(Finding("error", "all", (), name, f"{name} is {info.dtype} {list(info.shape)}, but every "
                               "engine allocates a 2-D weight for it from config.json",
                               "re-export the module as a 2-D weight", "tensor layout"))
        elif (want := fused_shape(name)) and tuple(info.shape) != want:
            out.append(Finding("error", "all", (), name, f"{name} is {info.dtype} {list(info.shape)}, but the "
                               f"engines size it {list(want)} from config.json ([experts, out, in])",
                               f"re-export {name} as {list(want)}", "tensor layout"))
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
