"""The shape of every parameter as the engines size it: from config.json, never from the stored tensor.

Engines allocate every parameter from the config and then copy the stored tensor in (vLLM/SGLang
`create_weights` per TP partition, FusedMoE `w13`/`w2` per expert, transformers `nn.Linear(in, out)`), so a
tensor stored in the wrong layout (MXFP4 left unpacked, packed along the output dimension, a scale grid of the
wrong size) is found by comparing it with the shape the config implies, and the finding names the tensor that
differs. The [out, in] formulas of each linear are model-family data (`shapes:` in manifests/families/*.yaml,
arithmetic over the text config's keys, optionally per model_type; quant/families/shapes.py); the stored-tensor shape
of each scheme
(packed MXFP4, E8M0 scales, block-FP8 grids) is derived from them in quant/verify/contract.py and block_fp8.py.
A module no formula covers falls back to the shape read back from its weight (contract.logical_shape).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import re
import runpy
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from quant.checkpoint import SHOWN, lm_layer_indices
from quant.engines import all_profiles
from quant.families import text_config, unknown_family_note
from quant.families.shapes import ShapeOf, config_shapes, shape_rules, tensor_shapes
from quant.verify.report import Finding

__all__ = ["ShapeOf", "config_shapes", "shape_rules", "tensor_shapes", "block_grid", "mx_weight", "mx_scale",
           "layout_findings", "consistency_findings", "known_model_types", "FP8_BLOCK", "MX_GROUP", "MX_PACK"]

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


def layout_findings(ckpt, shape_of: ShapeOf) -> list:
    """Tensors the engines cannot take whatever the scheme: a weight with a config shape rule that is not a
    non-empty 2-D tensor, a fused 3-D expert tensor of another shape than config.json sizes, and routed experts
    missing from a MoE layer that config.json sizes for all of them (engines allocate every expert and copy each
    by name; one never copied keeps uninitialised memory)."""
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
    key = next((k for k in ("n_routed_experts", "num_experts", "num_local_experts") if isinstance(cfg.get(k), int)),
               None)
    experts = cfg[key] if key else None
    if not experts:
        return out
    leaf = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")
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
                               f"({key}), missing: {', '.join(map(str, missing))}"
                               f"{' ...' if experts - present > 5 else ''}; "
                               "the engines build all of them and leave the missing ones uninitialised",
                               "export every expert", "tensor layout"))
    return out


# ------------------------------------------------- config vs tensors: an engine would fail (quant/validate.py)


@functools.lru_cache(maxsize=1)
def known_model_types() -> frozenset[str] | None:
    """The model types transformers' AutoConfig maps to a config class (CONFIG_MAPPING_NAMES), read from the
    installed transformers' generated table without importing the package (which imports torch); None when
    transformers is not installed or the table cannot be found."""

    try:
        spec = importlib.util.find_spec("transformers")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    table = Path(spec.origin).parent / "models" / "auto" / "auto_mappings.py"
    try:
        names = runpy.run_path(str(table))["CONFIG_MAPPING_NAMES"]
    except Exception:  # noqa: BLE001 - another transformers layout: ask the package itself
        try:
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES as names
        except Exception:  # noqa: BLE001
            return None
    # AutoConfig adds "gpt-sw3" (configuration_auto.py); no MoE family, listed for completeness.
    return frozenset(names) | {"gpt-sw3"}


@functools.lru_cache(maxsize=None)
def engine_registered(model_type: str) -> tuple[str, ...]:
    """The engine releases (labels such as "sglang==0.5.23") that parse this model_type with a config class of
    their own (engine rules config_registry), in the data's order."""

    return tuple(p.label for p in all_profiles() if model_type in p.rules.config_registry)


def _transformers_version() -> str:
    try:
        return version("transformers")
    except PackageNotFoundError:
        return "?"


def _missing_indices(present: set[int], count: int) -> tuple[int, list[int]]:
    """(how many of 0..count-1 are not in `present`, the first few of them), scanning no further than the
    number of present indices allows."""
    missing = count - sum(1 for i in present if i < count)
    shown = [i for i in range(min(count, len(present) + SHOWN)) if i not in present][:SHOWN]
    return missing, shown


def _listing(missing: int, shown: list[int]) -> str:
    return ", ".join(map(str, shown)) + (" ..." if missing > len(shown) else "")


def consistency_findings(ckpt, shape_of=None) -> list:
    """Where config.json and the tensors disagree so that an engine would fail or load wrong weights (see the
    module docstring), as preflight findings (engine "all")."""
    config = ckpt.config
    cfg = text_config(config)
    out: list = []
    model_type = config.get("model_type")
    known = known_model_types()
    auto_map = config.get("auto_map")
    remote = isinstance(auto_map, dict) and "AutoConfig" in auto_map
    if known is not None and isinstance(model_type, str) and model_type not in known and not remote \
            and not engine_registered(model_type):  # engine releases parsing it themselves: verify/schema.py
        out.append(Finding("error", "all", (), "config.json:model_type",
                           f"model_type {model_type!r} is not one transformers {_transformers_version()} knows: "
                           "AutoConfig (which every engine builds the config with) raises "
                           "ValueError", "use the model_type of the architecture (or an auto_map for remote code)",
                           "config consistency"))
    note = unknown_family_note(config)
    if note:
        # No family data: roles and shape rules are the name-generic ones; every name-generic check still runs.
        out.append(Finding("warning", "all", (), "config.json:model_type", note,
                           "add a family file (quant/manifests/families/NAME.yaml) for this model_type",
                           "model family"))
    layers = cfg.get("num_hidden_layers")
    if isinstance(layers, int) and not isinstance(layers, bool) and layers > 0:
        present = lm_layer_indices(ckpt.tensors)
        missing, shown = _missing_indices(present, layers)
        if present and missing:
            out.append(Finding("error", "all", (), f"model.layers.{shown[0]}.*",
                               f"config.json declares {layers} decoder layers (num_hidden_layers) but no tensor "
                               f"of {missing} of them is stored (layers {_listing(missing, shown)}): the engines "
                               "build every declared layer and have nothing to load into these",
                               "set num_hidden_layers to the layers the checkpoint holds, or export the missing "
                               "layers", "config consistency"))
    shape_of = shape_of or config_shapes(config)
    out += layout_findings(ckpt, shape_of)
    out += _expert_shape_findings(ckpt, shape_of)
    return out


def _expert_shape_findings(ckpt, shape_of) -> list:
    """Routed experts of an unquantized checkpoint whose [out, in] is not the config's: every engine allocates
    each expert from config.json and copies the stored one in. Quantized checkpoints store other shapes (packed
    MXFP4, scale grids); the preflight's tensor contracts check those."""
    if ckpt.config.get("quantization_config"):
        return []
    out = []
    for name, info in sorted(ckpt.tensors.items()):
        if ".experts." not in name or not name.endswith(".weight") or len(info.shape) != 2:
            continue
        want = shape_of(name[: -len(".weight")])
        if want and tuple(info.shape) != tuple(want) and 0 not in info.shape:
            out.append(Finding("error", "all", (), name, f"{name} is {info.dtype} {list(info.shape)}, but the "
                               f"engines size this expert {list(want)} from config.json",
                               f"re-export the expert as {list(want)} or correct config.json", "tensor layout"))
    return out
