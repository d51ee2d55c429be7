"""The tensors a module must have on disk for the scheme an engine builds it with (the create_weights below).

[out, in] is what the engine allocates from config.json (quant/verify/shapes.py), not what is stored:
MXFP4: `weight` U8 [out, in/2] + `weight_scale` U8 [out, in/32], in % 32 == 0, no `input_scale` (dynamic MX
activations; static ones need a scalar F32 `input_scale`). Sources: vLLM quark_ocp_mx.py QuarkOCP_MX.create_weights
(PackedvLLMParameter [out, in // 2], GroupQuantScaleParameter [out, in // 32]; ValueError when in/TP % 32),
quark_moe.py QuarkOCP_MX_MoEMethod.create_weights (w13 [E, 2*I/TP, H/2] + [E, 2*I/TP, H/32], w2 [E, H, I/TP/2] +
[E, H, I/TP/32]); SGLang quark_w4a4_mxfp4.py QuarkW4A4MXFP4.create_weights (same per-linear shapes).
FP8: `weight` F8_E4M3 [out, in] + `weight_scale` F32 [] (per_tensor) or [out] (per_channel), `input_scale` F32
scalar iff the input is static. MXFP8 ([1, 32], dynamic MXFP8 activations): `weight` F8_E4M3 [out, in] + `weight_scale`
U8 [out, in/32], in % 32 == 0 (in/TP when row-parallel), no `input_scale` (vLLM 0.32 quark_ocp_mx.py:175-201, the
unpacked branch: MXFP8_VALUE_DTYPE float8_e4m3fn, MXFP8_SCALE_DTYPE uint8 in utils/mxfp8_utils.py:9-10; experts in
0.33 quark_moe.py:2047-2082 QuarkW8A8Mxfp8MoEMethod.create_weights: w13 [E, 2*I/TP, H] + [E, 2*I/TP, H/32], w2
[E, H, I/TP] + [E, H, I/TP/32], ValueError unless H and I/TP are multiples of 32). Unquantized: `weight` in
BF16/F16/F32 and no scale tensors.
When the stored weight differs from the engine's parameter the weight itself is the finding (an MXFP4 weight
left unpacked, or packed along the output dimension, would otherwise look like a wrong scale).
"""

from __future__ import annotations

import re

from dataclasses import dataclass

from quant.checkpoint import FLOAT_DTYPES, TensorInfo
from quant.verify.modules import Module
from quant.verify.shapes import MX_GROUP, MX_PACK, mx_scale, mx_weight

MX_KINDS = ("mxfp4", "mxfp4_weight_only", "mxfp4_static_input", "w4a8_mxfp4_fp8")
MXFP8_KINDS = ("mxfp8", "mxfp8_block")  # stored like FP8 (F8_E4M3 weight), scaled like MXFP4 (E8M0 per 32 inputs)
FP8_KINDS = ("fp8", "fp8_weight_only", *MXFP8_KINDS)
SCALE_SUFFIXES = ("weight_scale", "input_scale", "weight_scale_inv", "weight_scale_2", "input_scale_2")
# Quantizer state an exporter can leak beside an unquantized weight (`weight_double_scale`, `output_scale`,
# `input_zero_point`, `weight_amax`...): a parameter no float linear has, so each loader drops or rejects it.
LEAKED = re.compile(r"scale|zero_point|amax")
KIND_LABEL = {"mxfp4": "MXFP4", "mxfp4_weight_only": "MXFP4 weight-only", "mxfp4_static_input":
              "MXFP4 (static activations)", "w4a8_mxfp4_fp8": "MXFP4 W4A8-FP8", "fp8": "FP8",
              "fp8_weight_only": "FP8 weight-only", "mxfp8": "MXFP8", "mxfp8_block": "MXFP8 (2-D blocks)",
              None: "unquantized"}


def family(kind: str | None) -> str:
    return "mxfp4" if kind in MX_KINDS else "fp8" if kind in FP8_KINDS else "float"


def stored_family(mod: Module) -> str:
    w = mod.weight
    if w is None:
        return "missing"
    if w.dtype == "U8":
        return "mxfp4"
    if w.dtype == "F8_E4M3":
        return "fp8"
    return "float" if w.dtype in FLOAT_DTYPES else w.dtype


def logical_shape(mod: Module) -> tuple[int, int] | None:
    """[out, in] of the original linear, read back from whatever dtype the weight is stored in (the fallback for
    a module no config.json formula covers)."""
    w = mod.weight
    if w is None or len(w.shape) != 2:
        return None
    out_f, cols = w.shape
    return (out_f, cols * MX_PACK) if w.dtype == "U8" else (out_f, cols)


def describe(info: TensorInfo | None) -> str:
    return "absent" if info is None else f"{info.dtype} {list(info.shape)}"


def expected_weight(kind: str | None, shape: tuple[int, int]) -> str:
    o, i = shape
    fam = family(kind)
    if fam == "mxfp4":
        return f"U8 {list(mx_weight(shape))} + weight_scale U8 {list(mx_scale(shape))}"
    if kind == "mxfp8_block":
        return f"F8_E4M3 [{o}, {i}] + weight_scale E8M0 [{o}/R, {i // MX_GROUP}] (R x 32 blocks)"
    if kind in MXFP8_KINDS:
        return f"F8_E4M3 [{o}, {i}] + weight_scale U8 {list(mx_scale(shape))}"
    if fam == "fp8":
        return f"F8_E4M3 [{o}, {i}] + weight_scale F32"
    return f"BF16 [{o}, {i}] and no scale tensors"


@dataclass(frozen=True)
class TensorIssue:
    tensor: str
    problem: str  # what is on disk
    expected: str
    family_mismatch: bool
    # A tensor the module as built has no parameter for: whether the loader drops or rejects it is the engine's
    # (engine rules stray_tensors), not the contract's.
    stray: bool = False


def stored_weight_shape(kind: str | None, shape: tuple[int, int]) -> tuple[int, int]:
    """The weight tensor's shape on disk for a linear of logical [out, in] under `kind`."""
    return mx_weight(shape) if family(kind) == "mxfp4" else tuple(shape)


def check_module(mod: Module, kind: str | None, layer_cfg: dict | None, row_parallel_tp: int | None = None,
                 config_shape: tuple[int, int] | None = None) -> list[TensorIssue]:
    """Issues of one module against `kind` (None: built unquantized). `row_parallel_tp`: the TP degree when
    the module is row-parallel (its input dimension is split). `config_shape`: the [out, in] the engine
    allocates from config.json; without it the shape is read back from the stored weight."""
    name = mod.name
    shape = config_shape or logical_shape(mod)
    if shape is None or mod.weight is None or len(mod.weight.shape) != 2:
        return [TensorIssue(f"{name}.weight", describe(mod.weight), "a 2-D weight", False)]
    want, have = family(kind), stored_family(mod)
    w = mod.weight
    if want != have:
        scales = [s for s in SCALE_SUFFIXES if s in mod.params]
        extra = f" (+ {', '.join(scales)})" if scales else ""
        return [TensorIssue(f"{name}.weight", f"{describe(w)}{extra}", expected_weight(kind, shape), True)]
    o, i = shape
    if config_shape and tuple(w.shape) != stored_weight_shape(kind, shape):
        # The engine copies the stored tensor into a parameter sized from config.json: the weight is what is
        # wrong, whatever its scales say (e.g. MXFP4 left unpacked, or packed along the output dimension).
        so, si = stored_weight_shape(kind, shape)
        packing = " (two FP4 values per byte along the input dimension)" if want == "mxfp4" else ""
        return [TensorIssue(f"{name}.weight", describe(w) + _layout_hint(want, tuple(w.shape), shape),
                            f"{w.dtype} [{so}, {si}]{packing}, as sized from config.json ([out, in] = [{o}, {i}])",
                            False)]
    return _scale_issues(mod, kind, layer_cfg, shape, row_parallel_tp)


def _scale_issues(mod: Module, kind: str | None, layer_cfg: dict | None, shape: tuple[int, int],
                  row_parallel_tp: int | None) -> list[TensorIssue]:
    """The scale tensors of a module whose weight has the dtype and shape `kind` wants."""
    name, w, (o, i) = mod.name, mod.weight, shape
    issues: list[TensorIssue] = []

    def need(suffix: str, dtype: str, shapes: list[tuple[int, ...]], label: str) -> None:
        info = mod.params.get(suffix)
        if info is None or info.dtype != dtype or tuple(info.shape) not in shapes:
            issues.append(TensorIssue(f"{name}.{suffix}", describe(info), label, False))

    def forbid(*suffixes: str) -> None:
        for suffix in suffixes:
            if suffix in mod.params:
                issues.append(TensorIssue(f"{name}.{suffix}", describe(mod.params[suffix]),
                                          "absent (the engine has no parameter for it)", False, stray=True))

    forbid(*(s for s in mod.params if s not in SCALE_SUFFIXES and LEAKED.search(s)))  # in no scheme's layout
    if family(kind) == "float":
        forbid(*SCALE_SUFFIXES)
        return issues
    act = (layer_cfg or {}).get("input_tensors") if isinstance(layer_cfg, dict) else None
    static_input = isinstance(act, dict) and act.get("is_dynamic") is False
    if kind in MX_KINDS or kind in MXFP8_KINDS:
        # MXFP4 and MXFP8 alike: one E8M0 byte per 32 inputs, [out, in/32] (vLLM quark_ocp_mx.py create_weights,
        # the packed and the unpacked branch; quark_moe.py QuarkW8A8Mxfp8MoEMethod in 0.33).
        if i % MX_GROUP:
            issues.append(TensorIssue(f"{name}.weight", f"{describe(w)} (in = {i})",
                                      f"an input dimension divisible by {MX_GROUP} (MX blocks)", False))
        elif kind == "mxfp8_block":
            issues += _block_scale_issues(mod, layer_cfg, shape)
        else:
            need("weight_scale", "U8", [mx_scale(shape)],
                 f"U8 {list(mx_scale(shape))} (E8M0, one byte per {MX_GROUP} inputs)")
        # vLLM QuarkOCP_MX.create_weights raises ValueError("OCP MX linear layer ... input size per partition ...
        # must be divisible by the OCP MX group size 32"); FusedMoE w2 takes I/TP // 32 scale columns.
        if row_parallel_tp and (i % row_parallel_tp or (i // row_parallel_tp) % MX_GROUP):
            issues.append(TensorIssue(f"{name}.weight", f"{describe(w)} (in = {i})",
                                      f"in/TP = {i}/{row_parallel_tp} divisible by {MX_GROUP} (row-parallel split)",
                                      False))
        input_label = "F32 scalar (static activations)"
    else:
        wq = (layer_cfg or {}).get("weight") or {}
        if wq.get("qscheme") == "per_tensor":
            need("weight_scale", "F32", [(), (1,)], "F32 scalar (per_tensor)")
        else:
            need("weight_scale", "F32", [(o,)], f"F32 [{o}] (per_channel)")
        input_label = "F32 scalar (static per-tensor input)"
    if static_input:
        need("input_scale", "F32", [(), (1,)], input_label)
    else:
        forbid("input_scale")
    # A second scale leaked beside the one the scheme loads (weight_scale_inv of a block-FP8 source, NVFP4's
    # weight_scale_2 / input_scale_2): the module has no parameter for it.
    forbid("weight_scale_inv", "weight_scale_2", "input_scale_2")
    return issues


def _block_scale_issues(mod: Module, layer_cfg: dict | None, shape: tuple[int, int]) -> list[TensorIssue]:
    """An MXFP8 weight spelled in [R, 32] blocks: one E8M0 byte per R rows x 32 inputs, [out/R, in/32], read as bytes
    (U8 or F8_E8M0) and repeated R times along the rows into the [out, in/32] parameter, so out must be a multiple
    of R (vLLM quark_ocp_mx.py:127-145 _expanding_scale_loader, quark.py:163-175 _scale_block_rows)."""
    o, i = shape
    rows = ((layer_cfg or {}).get("weight") or {}).get("block_size", [1])[0]
    info = mod.params.get("weight_scale")
    want = (o // rows, i // MX_GROUP)
    label = f"U8 or F8_E8M0 {list(want)} (E8M0, one byte per {rows} x {MX_GROUP} block)"
    if o % rows:
        return [TensorIssue(f"{mod.name}.weight", f"{describe(mod.weight)} (out = {o})",
                            f"an output dimension divisible by {rows} (the scale is repeated {rows} times per row)",
                            False)]
    if info is None or info.dtype not in ("U8", "F8_E8M0") or tuple(info.shape) != want:
        return [TensorIssue(f"{mod.name}.weight_scale", describe(info), label, False)]
    return []


def _layout_hint(want: str, stored: tuple[int, ...], shape: tuple[int, int]) -> str:
    """What a mis-stored MXFP4 weight most likely is, by comparing its shape with the config's [out, in]."""
    if want != "mxfp4" or len(stored) != 2:
        return ""
    o, i = shape
    if stored == (o, i):
        return " (one FP4 code per byte: not packed)"
    if stored == (o // MX_PACK, i):
        return " (packed along the output dimension)"
    if stored == (i // MX_PACK, o) or stored == (i, o // MX_PACK):
        return " (transposed)"
    return ""
