"""Checkpoints that arrive already microscaled: every quantized weight is stored as element codes plus a sibling
tensor of block scales, recognised from the safetensors headers alone. The formats, as data (`FORMATS`):

- MXFP4 (`mxfp4`, DeepSeek-V4's routed experts): `X.weight` I8 (or U8) [..., R, K/2], two E2M1 codes per byte, the
  even element in the LOW nibble (torch float4_e2m1fn_x2, transformers' `_unpack_fp4`, DeepSeek's inference code);
  `X.scale` F8_E8M0 (or U8) [..., R, K/32], one exponent per 32 consecutive inputs. Byte b means 2^(b - 127); 0xFF
  is NaN.
- UE8M0 block FP8 (`fp8-ue8m0`): `X.weight` F8_E4M3 [O, I]; `X.scale` F8_E8M0 [ceil(O/b), ceil(I/b)] with b = 128
  (DeepSeek-V4 attention and shared experts) or 32 (DeepSeek-V4.1's dense layers; vLLM's deepseek_v41 quant_config
  loads that layout as MXFP8 with a 32x32 scale block); value = code * 2^(s - 127).
- MXFP8 (`mxfp8`, MiniMax-M3's official release, `quant_method: mxfp8`): `X.weight` F8_E4M3 [O, I] with
  `X.weight_scale_inv` U8 (or F8_E8M0) E8M0 bytes, [O, I/32] ([1, 32] blocks, OCP MX) or [ceil(O/32), I/32] ([32, 32]
  blocks). vLLM 0.32 loads it with its ModelOpt MXFP8 config (modelopt.py ModelOptMxFp8Config.from_config:
  "MiniMax-style checkpoints tag quant_method mxfp8 + ignored_layers") after renaming weight_scale_inv to weight_scale
  (models/minimax_m3/*/model.py), and decodes with `dequant_mxfp8_to_bf16` (code * 2^(s - 127)). A `weight_scale_inv`
  in F32/BF16 is the official 128x128 block-FP8 format instead (quant.planning), not this one.
- compressed-tensors MXFP4 (`ct-mxfp4`, format `mxfp4-pack-quantized`, Kimi-K3's release): `X.weight_packed` U8
  [O, I/2] (compressed_tensors.compressors.nvfp4.helpers.pack_fp4_to_uint8: element 2i in the low nibble, sign in
  bit 3, magnitude index into [0, .5, 1, 1.5, 2, 3, 4, 6], i.e. the E2M1 bit pattern) and `X.weight_scale` U8 [O, I/32]
  of E8M0 exponents (compressors/mx_utils.py: 127 + floor(log2 scale); decompress 2^(b - 127)).
- compressed-tensors NVFP4 (`ct-nvfp4`, format `nvfp4-pack-quantized`): the same packed codes with `X.weight_scale`
  F8_E4M3 [O, I/16] and `X.weight_global_scale` F32 [1]; value = code * (scale / global_scale)
  (quantization/lifecycle/forward_helpers.py `_dequantize`: the local scale divided by the global one first). A static
  activation `X.input_global_scale` may sit beside it; it describes activations, not the weight, and is consumed.

Decoding is exact for every MX/UE8M0 format: an E2M1 or E4M3 value times a power of two is an fp32 number (the only
exceptions are scales beyond fp32's range, which are refused). NVFP4's value is the reference's own fp32 arithmetic,
op for op (scale / global_scale rounded once to fp32, then times the code, exact), so it equals what compressed-tensors
and vLLM compute. Quark stores MXFP4 as uint8 `weight` [R, K/2] (even element in the low nibble, as quant/numerics/
mxfp4.py packs) + uint8 `weight_scale` [R, K/32] and MXFP8 as float8_e4m3fn `weight` [O, I] + uint8 `weight_scale`
[O, I/32]: the same bytes, so a weight headed for its own format is carried over (`to_quark_mxfp4`, `to_quark_mxfp8`:
a [b, b]-block scale written once per row it covers, the same value for every element), never decoded."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from quant.errors import QuantError

if TYPE_CHECKING:
    import torch

__all__ = ["MXFP4", "FP8_UE8M0", "MXFP8", "CT_MXFP4", "CT_NVFP4", "MODELOPT_NVFP4", "QUARK_MXFP4", "QUARK_MXFP8",
           "QUARK_FP8", "NVFP4_KINDS", "FORMATS", "Format", "SCALE_SUFFIX", "Encoding", "recognise", "scale_name",
           "decode", "decode_mxfp4", "decode_fp8_ue8m0", "decode_nvfp4", "decode_fp8_scaled", "to_quark_mxfp4",
           "to_quark_mxfp8", "to_quark_fp8", "to_fp8_block", "exact_blocks", "scale_tensors", "PACKED_KINDS",
           "MX_KINDS", "encode_as", "missing_scale"]

MXFP4 = "mxfp4"
FP8_UE8M0 = "fp8-ue8m0"
MXFP8 = "mxfp8"
CT_MXFP4 = "ct-mxfp4"
CT_NVFP4 = "ct-nvfp4"
MODELOPT_NVFP4 = "modelopt-nvfp4"
QUARK_MXFP4 = "quark-mxfp4"
QUARK_MXFP8 = "quark-mxfp8"
QUARK_FP8 = "quark-fp8"
SCALE_SUFFIX = ".scale"
MX_BLOCK = 32
FP8_BLOCKS = (128, 32)  # DeepSeek-V4: 128x128; DeepSeek-V4.1-Flash dense layers: 32x32
CODE_DTYPES = ("I8", "U8")
E8M0_DTYPES = ("F8_E8M0", "U8")
PACKED_KINDS = (MXFP4, CT_MXFP4, CT_NVFP4, MODELOPT_NVFP4, QUARK_MXFP4)  # two E2M1 codes per stored byte
MX_KINDS = (MXFP4, CT_MXFP4, QUARK_MXFP4)  # E2M1 codes with E8M0 scales per [1, 32]: Quark MXFP4's own bytes
NVFP4_KINDS = (CT_NVFP4, MODELOPT_NVFP4)  # E2M1 codes, E4M3 scales per 16, one F32 global scale
E8M0_FP8_KINDS = (MXFP8, QUARK_MXFP8, FP8_UE8M0)  # E4M3 codes with E8M0 scales over [rb, cb] blocks


@dataclass(frozen=True)
class Format:
    """One stored encoding: the weight tensor `X<weight>` and its scale `X<scale>` (dtypes, the blocks [rows,
    inputs] its scale may cover), whether codes are packed E2M1 pairs, and for NVFP4 the per-tensor global scale and
    tensors consumed with the weight without being needed to decode it."""

    kind: str
    weight: str
    scale: str
    code_dtypes: tuple[str, ...]
    scale_dtypes: tuple[str, ...]
    blocks: tuple[tuple[int, int], ...]
    packed: bool
    global_scale: str = ""
    consumed: tuple[str, ...] = ()
    release: str = ""
    global_multiplies: bool = False  # NVFP4: ModelOpt's weight_scale_2 multiplies, compressed-tensors' divides


FORMATS = (
    Format(MXFP4, ".weight", ".scale", CODE_DTYPES, E8M0_DTYPES, ((1, MX_BLOCK),), True,
           release="DeepSeek-V4 routed experts"),
    Format(FP8_UE8M0, ".weight", ".scale", ("F8_E4M3",), E8M0_DTYPES, ((128, 128), (32, 32)), False,
           release="DeepSeek-V4 attention / shared experts (128x128), DeepSeek-V4.1 dense layers (32x32)"),
    Format(MXFP8, ".weight", ".weight_scale_inv", ("F8_E4M3",), E8M0_DTYPES, ((1, MX_BLOCK), (MX_BLOCK, MX_BLOCK)),
           False, release="MiniMax-M3's MXFP8 release (quant_method mxfp8)"),
    Format(CT_MXFP4, ".weight_packed", ".weight_scale", ("U8",), ("U8",), ((1, MX_BLOCK),), True,
           release="compressed-tensors mxfp4-pack-quantized (Kimi-K3)"),
    Format(CT_NVFP4, ".weight_packed", ".weight_scale", ("U8",), ("F8_E4M3",), ((1, 16),), True,
           global_scale=".weight_global_scale", consumed=(".input_global_scale",),
           release="compressed-tensors nvfp4-pack-quantized"),
    Format(MODELOPT_NVFP4, ".weight", ".weight_scale", ("U8",), ("F8_E4M3",), ((1, 16),), True,
           global_scale=".weight_scale_2", consumed=(".input_scale",), global_multiplies=True,
           release="ModelOpt NVFP4 (MiniMax-M3.1-Flash's routed experts)"),
    Format(QUARK_MXFP4, ".weight", ".weight_scale", ("U8",), ("U8",), ((1, MX_BLOCK),), True,
           consumed=(".input_scale",), release="a Quark MXFP4 export (this tool's, AMD's)"),
    Format(QUARK_MXFP8, ".weight", ".weight_scale", ("F8_E4M3",), E8M0_DTYPES, ((1, MX_BLOCK), (MX_BLOCK, MX_BLOCK)),
           False, consumed=(".input_scale",),
           release="a Quark MXFP8 export ([1, 32]; AMD's [32, 32] per-block spelling)"),
    Format(QUARK_FP8, ".weight", ".weight_scale", ("F8_E4M3",), ("F32",), ((0, 0), (1, 0)), False,
           consumed=(".input_scale",), release="a Quark FP8 export (per-tensor or per-channel F32 weight_scale)"),
)


@dataclass(frozen=True)
class Encoding:
    """How one stored weight encodes its values: `kind` (a Format's), its scale tensor, the block the scale covers
    ([1, 32] for MX, [b, b] for block FP8, [1, 16] for NVFP4), the logical (decoded) shape, the module it is the
    weight of (`X` of `X.weight` / `X.weight_packed`) and, for NVFP4, its global-scale tensor."""

    kind: str
    scale: str
    block: tuple[int, int]
    shape: tuple[int, ...]
    module: str = ""
    global_scale: str = ""


def _candidates(weight: str):
    for fmt in FORMATS:
        if weight.endswith(fmt.weight):
            yield fmt, weight[: -len(fmt.weight)]


def missing_scale(tensors, name: str) -> str | None:
    """The scale tensor a stored weight named only as packed codes are (`X.weight_packed`) needs and lacks: such a
    tensor is no plain weight, and without its scale it cannot be decoded (None when `name` is no such tensor, or
    its scale is present)."""
    for fmt, module in _candidates(name):
        if fmt.weight != ".weight" and module + fmt.scale not in tensors:
            return module + fmt.scale
    return None


def scale_name(weight: str) -> str | None:
    """The E8M0 scale tensor that goes with a DeepSeek-V4 style `weight` (`X.weight` -> `X.scale`), None for other
    names."""
    return weight[: -len(".weight")] + SCALE_SUFFIX if weight.endswith(".weight") else None


def _is_companion(fmt: Format, tensors, weight: str, scale: str) -> bool:
    """Whether `scale` (present) is this format's scale: a `weight_scale_inv` in F32/BF16 is block FP8's, not
    MXFP8's; a `weight_scale` beside a `weight` is a Quark or ModelOpt scale only when the pair's dtypes are one of
    theirs (a BF16 weight with a stray `weight_scale` is a plain weight, its stray tensor judged elsewhere)."""
    if fmt.scale == ".weight_scale_inv":
        return tensors[scale].dtype in fmt.scale_dtypes
    if fmt.weight == ".weight" and fmt.scale == ".weight_scale":
        pair = (tensors[weight].dtype, tensors[scale].dtype)
        return any(pair[0] in f.code_dtypes and pair[1] in f.scale_dtypes for f in FORMATS
                   if (f.weight, f.scale) == (".weight", ".weight_scale"))
    return True


def scale_tensors(tensors) -> set[str]:
    """The names in `tensors` (name -> info with .dtype/.shape) that belong to a stored weight of a microscaled
    format: its scales, global scales and consumed siblings (each decoded or dropped with its weight)."""
    out = set()
    for name in tensors:
        for fmt, module in _candidates(name):
            scale = module + fmt.scale
            if scale in tensors and _is_companion(fmt, tensors, name, scale):
                out.add(scale)
                out.update(s for s in (module + fmt.global_scale if fmt.global_scale else "",
                                       *(module + c for c in fmt.consumed)) if s and s in tensors)
    return out


PER_TENSOR, PER_CHANNEL = (0, 0), (1, 0)  # FP8 scale "blocks": the whole tensor, one row


def _expected(block: tuple[int, int], logical: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The scale shapes a weight of decoded shape `logical` may have under `block` (none: the input dim is not a
    whole number of per-row groups)."""
    rows, k = logical[-2], logical[-1]
    if block == PER_TENSOR:
        return ((), (1,))
    if block == PER_CHANNEL:
        return ((rows,), (rows, 1))
    rb, cb = block
    if rb == 1 and k % cb:
        return ()
    return ((*logical[:-2], math.ceil(rows / rb), math.ceil(k / cb)),)


def recognise(tensors, weight: str, where: str = "") -> Encoding | None:
    """The Encoding of `weight` from headers alone (`tensors`: name -> info with .dtype and .shape), None when
    it has no scale sibling of a microscaled format (a plain BF16/F32 tensor, or a block-FP8 one with an F32
    weight_scale_inv). A weight or scale whose dtype or shape fits no format is refused, naming both tensors."""
    where = where or weight
    for fmt, module in _candidates(weight):
        scale = module + fmt.scale
        if scale not in tensors or not _is_companion(fmt, tensors, weight, scale):
            continue
        w, s = tensors[weight], tensors[scale]
        wshape, sshape = tuple(w.shape), tuple(s.shape)
        same_pair = [f for f, _ in _candidates(weight) if f.scale == fmt.scale]
        if not any(w.dtype in f.code_dtypes and s.dtype in f.scale_dtypes for f in same_pair):
            if fmt.weight == ".weight_packed":
                raise QuantError(f"{where}: {weight} {w.dtype} with {scale} {s.dtype} is neither compressed-tensors "
                                 f"MXFP4 (U8 codes, U8 E8M0 scales) nor NVFP4 (U8 codes, F8_E4M3 scales); integer "
                                 f"pack-quantized sources are not supported")
            if s.dtype not in E8M0_DTYPES:
                raise QuantError(f"{where}: {scale} is {s.dtype}, expected E8M0 exponents (F8_E8M0 or U8)")
            codes = " or ".join(f"{'/'.join(f.code_dtypes)} ({f.kind})" for f in same_pair)
            raise QuantError(f"{where}: {weight} is {w.dtype} beside E8M0 scales {scale}; expected {codes} codes")
        if w.dtype not in fmt.code_dtypes or s.dtype not in fmt.scale_dtypes:
            continue  # the other format with these names (MXFP4 vs FP8_UE8M0, CT MXFP4 vs NVFP4)
        if module + ".weight_zero_point" in tensors:
            raise QuantError(f"{where}: {module}.weight_zero_point: asymmetric (zero-point) FP4 is not supported")
        logical = (*wshape[:-1], wshape[-1] * 2) if fmt.packed else wshape
        if len(wshape) < 2 or (not fmt.packed and len(wshape) != 2):
            raise QuantError(f"{where}: {weight} {w.dtype} {list(wshape)} with {scale} {list(sshape)}: a {fmt.kind} "
                             f"weight must be {'at least ' if fmt.packed else ''}2-D")
        for block in fmt.blocks:
            if sshape in _expected(block, logical):
                glob = module + fmt.global_scale if fmt.global_scale else ""
                if glob:
                    g = tensors.get(glob)
                    if g is None:
                        raise QuantError(f"{where}: {weight} is NVFP4 but {glob} is missing")
                    if g.dtype != "F32" or math.prod(g.shape) != 1:
                        raise QuantError(f"{where}: {glob} is {g.dtype} {list(g.shape)}, expected one F32 value")
                return Encoding(fmt.kind, scale, block, logical, module, glob)
        if fmt.kind == MXFP4:
            raise QuantError(f"{where}: {weight} {w.dtype} {list(wshape)} with {scale} {list(sshape)} is not MXFP4 "
                             f"(expected a scale of shape [..., K/32] for packed codes [..., K/2])")
        wanted = " or ".join(str(list(e)) for b in fmt.blocks for e in _expected(b, logical))
        raise QuantError(f"{where}: {weight} {w.dtype} {list(wshape)} with {scale} {list(sshape)} matches no "
                         f"{fmt.kind} block size ({' or '.join(_block_label(b) for b in fmt.blocks)}: scale "
                         f"{wanted or 'none, the input dim is not a multiple of the group'})")
    return None


def _block_label(block: tuple[int, int]) -> str:
    return {PER_TENSOR: "per-tensor", PER_CHANNEL: "per-channel"}.get(block, f"{block[0]}x{block[1]}")


def _bytes(t: "torch.Tensor") -> "torch.Tensor":
    import torch

    return t.contiguous().view(torch.uint8)


def _check_scales(scale_bytes: "torch.Tensor", what: str) -> None:
    if bool((scale_bytes == 255).any()):
        raise QuantError(f"{what}: E8M0 scale byte 0xFF (NaN) in the source")


def decode_mxfp4(codes: "torch.Tensor", scales: "torch.Tensor", what: str = "MXFP4 weight") -> "torch.Tensor":
    """fp32 [..., K] from packed codes [..., K/2] (int8 or uint8) and E8M0 scales [..., K/32] (float8_e8m0fnu or
    uint8), exactly."""
    import torch

    from quant.numerics import mxfp4

    packed, scale_bytes = _bytes(codes), _bytes(scales)
    _check_scales(scale_bytes, what)
    out = mxfp4.dequantize_mxfp4(packed, scale_bytes, dtype=torch.float32)
    if not bool(torch.isfinite(out).all()):
        raise QuantError(f"{what}: values beyond fp32's range (E8M0 scale too large)")
    return out


def _expand(values: "torch.Tensor", block: tuple[int, int], shape: tuple[int, int]) -> "torch.Tensor":
    """A per-block tensor [ceil(O/rb), ceil(I/cb)] written once per element [O, I]."""
    rb, cb = block
    return values.repeat_interleave(rb, 0)[: shape[0]].repeat_interleave(cb, 1)[:, : shape[1]]


def decode_fp8_ue8m0(q: "torch.Tensor", scales: "torch.Tensor", block, what: str = "FP8 weight"
                     ) -> "torch.Tensor":
    """fp32 [O, I] from float8_e4m3fn codes and E8M0 scales over [rb, cb] blocks ([ceil(O/rb), ceil(I/cb)]; an int
    b means [b, b]), exactly: UE8M0 block FP8 and MXFP8 ([1, 32] / [32, 32])."""
    import torch

    from quant.numerics import mxfp4

    block = (block, block) if isinstance(block, int) else tuple(block)
    scale_bytes = _bytes(scales)
    _check_scales(scale_bytes, what)
    o, i = q.shape
    if tuple(scale_bytes.shape) != (math.ceil(o / block[0]), math.ceil(i / block[1])):
        raise QuantError(f"{what}: FP8 shape {list(q.shape)} does not match scale shape {list(scale_bytes.shape)} "
                         f"for {block[0]}x{block[1]} blocks")
    out = q.contiguous().view(torch.float8_e4m3fn).to(torch.float32) * _expand(mxfp4.scale_values(scale_bytes),
                                                                              block, (o, i))
    if not bool(torch.isfinite(out).all()):
        raise QuantError(f"{what}: non-finite values (NaN codes, or an E8M0 scale beyond fp32's range)")
    return out


def decode_nvfp4(codes: "torch.Tensor", scales: "torch.Tensor", global_scale: "torch.Tensor",
                 what: str = "NVFP4 weight", multiplies: bool = False) -> "torch.Tensor":
    """fp32 [O, K] from packed E2M1 codes [O, K/2] (uint8), float8_e4m3fn scales [O, K/16] and the F32 global scale,
    in each reference's order of operations: compressed-tensors code * fp32(scale / global_scale)
    (forward_helpers._dequantize); ModelOpt (`multiplies`: `weight_scale_2` = amax / (6 * 448)) code *
    fp32(scale * weight_scale_2) (vLLM 0.32 quantization/utils/nvfp4_emulation_utils.py dequantize_to_dtype,
    :559-613: `tensor_sf.to(float32) * global_scale`, then times the E2M1 values)."""
    import torch

    packed = _bytes(codes)
    k = packed.shape[-1] * 2
    elements = _e2m1(packed)
    g = global_scale.reshape(-1)[:1].to(torch.float32)
    block = scales.contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    local = block * g if multiplies else block / g
    out = elements * local.repeat_interleave(16, -1)[..., :k]
    if not bool(torch.isfinite(out).all()):
        raise QuantError(f"{what}: non-finite values (a zero or non-finite global scale, or NaN scales)")
    return out


def _e2m1(packed: "torch.Tensor") -> "torch.Tensor":
    """The E2M1 values of packed pairs (even element in the low nibble), fp32."""
    import torch

    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    pairs = torch.stack([packed & 0xF, packed >> 4], dim=-1).to(torch.int64)
    return table[pairs].reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def decode_fp8_scaled(q: "torch.Tensor", scale: "torch.Tensor", what: str = "FP8 weight") -> "torch.Tensor":
    """fp32 [O, I] of an FP8 weight with an F32 per-tensor ([] / [1]) or per-channel ([O] / [O, 1]) scale: code *
    scale, one fp32 product (vLLM's and Quark's dequantization)."""
    import torch

    s = scale.to(torch.float32)
    s = s.reshape(-1, 1) if s.numel() == q.shape[0] and s.numel() > 1 else s.reshape(())
    out = q.contiguous().view(torch.float8_e4m3fn).to(torch.float32) * s
    if not bool(torch.isfinite(out).all()):
        raise QuantError(f"{what}: non-finite values (NaN codes or a non-finite scale)")
    return out


def decode(encoding: Encoding, weight: "torch.Tensor", scale: "torch.Tensor", what: str = "",
           global_scale: "torch.Tensor | None" = None) -> "torch.Tensor":
    """The fp32 values of a stored weight and its scale tensor (and NVFP4's global scale) under `encoding`."""
    if encoding.kind in MX_KINDS:
        return decode_mxfp4(weight, scale, what or "MXFP4 weight")
    if encoding.kind in NVFP4_KINDS:
        if global_scale is None:
            raise QuantError(f"{what or 'NVFP4 weight'}: no global scale")
        return decode_nvfp4(weight, scale, global_scale, what or "NVFP4 weight",
                            multiplies=encoding.kind == MODELOPT_NVFP4)
    if encoding.kind == QUARK_FP8:
        return decode_fp8_scaled(weight, scale, what or "FP8 weight")
    return decode_fp8_ue8m0(weight, scale, encoding.block, what or "FP8 weight")


def to_quark_mxfp4(codes: "torch.Tensor", scales: "torch.Tensor") -> dict[str, "torch.Tensor"]:
    """Quark's MXFP4 parts (uint8 `weight` [..., K/2], uint8 `weight_scale` [..., K/32]) of a native MXFP4 weight:
    the same bytes (same nibble order), reinterpreted; nothing is decoded or rounded. A 0xFF (NaN) scale is refused,
    as decoding refuses it."""
    scale_bytes = _bytes(scales)
    _check_scales(scale_bytes, "MXFP4 weight")
    return {"weight": _bytes(codes).clone(), "weight_scale": scale_bytes.clone()}


def to_quark_mxfp8(q: "torch.Tensor", scales: "torch.Tensor", block: tuple[int, int]) -> dict[str, "torch.Tensor"]:
    """Quark's MXFP8 parts (float8_e4m3fn `weight` [O, I], uint8 `weight_scale` [O, I/32]) of an FP8 weight with E8M0
    scales over [rb, cb] blocks (cb a multiple of 32): the same E4M3 codes, each scale byte written for every [1, 32]
    group its block covers, so every element keeps its scale; nothing is decoded or rounded."""
    import torch

    rb, cb = block
    o, i = q.shape
    if cb % MX_BLOCK or i % MX_BLOCK:
        raise QuantError(f"FP8 weight {list(q.shape)} with {rb}x{cb} blocks cannot be written as MXFP8 [1, 32]")
    scale_bytes = _bytes(scales)
    _check_scales(scale_bytes, "FP8 weight")
    per_group = scale_bytes.repeat_interleave(rb, 0)[:o].repeat_interleave(cb // MX_BLOCK, 1)[:, : i // MX_BLOCK]
    return {"weight": q.contiguous().view(torch.float8_e4m3fn).clone(), "weight_scale": per_group.contiguous().clone()}


def to_quark_fp8(q: "torch.Tensor", scale: "torch.Tensor") -> dict[str, "torch.Tensor"]:
    """Quark per-channel FP8 parts (float8_e4m3fn `weight` [O, I], F32 `weight_scale` [O]) of a Quark FP8 weight: the
    same codes, a per-tensor scale written once per row (the same value for every element)."""
    import torch

    rows = q.shape[0]
    s = scale.to(torch.float32).reshape(-1)
    return {"weight": q.contiguous().view(torch.float8_e4m3fn).clone(),
            "weight_scale": (s if s.numel() == rows else s[:1].expand(rows)).contiguous().clone()}


def to_fp8_block(q: "torch.Tensor", scales: "torch.Tensor") -> dict[str, "torch.Tensor"]:
    """Official block-FP8 parts (float8_e4m3fn `weight`, F32 `weight_scale_inv`) of a UE8M0 128x128 FP8 weight:
    the same E4M3 codes, each E8M0 byte written as the fp32 power of two it means (exact; 0xFF refused)."""
    import torch

    from quant.numerics import mxfp4

    scale_bytes = _bytes(scales)
    _check_scales(scale_bytes, "FP8 weight")
    return {"weight": q.contiguous().view(torch.float8_e4m3fn).clone(),
            "weight_scale_inv": mxfp4.scale_values(scale_bytes).clone()}


# Writing the formats (toys and tests): the release's own rules, deliberately not quant/numerics' RTN rule, so a
# tool that decodes and re-rounds a native source is caught changing it.

def encode_mxfp4_release(x: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """A weight [..., K] as a release stores native MXFP4: (int8 codes [..., K/2], float8_e8m0fnu scales
    [..., K/32]). The scale rule is one above OCP's floor (amax / 2^e in [2, 4): no element ever saturates, the
    top codes unused), elements rounded to nearest-even under it; `quantize_mxfp4` (any mode) picks a smaller
    exponent for almost every block, so requantizing the decoded values changes codes and scales."""
    import torch

    from quant.numerics import mxfp4

    _, floor = mxfp4.quantize_mxfp4(x, mode="floor")
    scales = (floor.to(torch.int32) + 1).clamp(max=254).to(torch.uint8)
    codes = mxfp4.encode_with_scales(x, scales)
    return codes.view(torch.int8), scales.view(torch.float8_e8m0fnu)


def encode_fp8_ue8m0(x: "torch.Tensor", block: int = 128) -> tuple["torch.Tensor", "torch.Tensor"]:
    """A 2-D weight as UE8M0 block FP8: (float8_e4m3fn [O, I], float8_e8m0fnu [ceil(O/b), ceil(I/b)]) with each
    block's scale the least power of two that keeps amax within E4M3's 448 (DeepSeek-V3.2/V4's `scale_fmt:
    ue8m0`)."""
    import torch

    o, i = x.shape
    to, ti = math.ceil(o / block), math.ceil(i / block)
    padded = torch.zeros(to * block, ti * block, dtype=torch.float32)
    padded[:o, :i] = x.float()
    amax = padded.view(to, block, ti, block).abs().amax(dim=(1, 3))
    exponent = torch.ceil(torch.log2(torch.clamp(amax, min=2.0**-100) / 448.0)).clamp(-127, 127)
    exponent = torch.where(amax == 0, torch.full_like(exponent, -127), exponent)
    full = torch.exp2(exponent).repeat_interleave(block, 0).repeat_interleave(block, 1)
    q = (padded / full)[:o, :i].to(torch.float8_e4m3fn)
    scales = (exponent.to(torch.int32) + 127).to(torch.uint8)
    return q, scales.view(torch.float8_e8m0fnu)


def encode_mxfp8_release(x: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """A 2-D weight as MiniMax-M3's MXFP8 release stores it: (float8_e4m3fn [O, I], uint8 E8M0 `weight_scale_inv`
    [O, I/32]) under the scale rule vLLM's and ModelOpt's MXFP8 quantizers use (e = ceil(log2(amax / 448)):
    vllm/model_executor/layers/quantization/utils/mxfp8_utils.py `_mxfp8_e4m3_quantize_torch`), not this tool's
    default ("even"), so requantizing the decoded values changes the bytes of every block whose amax lands below 256."""
    from quant.numerics import mxfp8

    return mxfp8.quantize_mxfp8(x.float(), mode="rceil")


def encode_nvfp4(x: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    """A 2-D weight as compressed-tensors NVFP4: (uint8 packed E2M1 [O, I/2], float8_e4m3fn scales [O, I/16], F32
    global scale [1]) with compressed-tensors' rules: global = 448 * 6 / amax(tensor), each block's scale
    fp8(amax_block / 6 * global), elements the nearest E2M1 value of x / (scale / global), even element in the low
    nibble."""
    import torch

    x = x.float()
    o, i = x.shape
    global_scale = (448.0 * 6.0 / x.abs().amax().clamp(min=1e-12)).reshape(1)
    blocks = x.reshape(o, i // 16, 16)
    scales = (blocks.abs().amax(-1) / 6.0 * global_scale).clamp(max=448.0).to(torch.float8_e4m3fn)
    local = scales.float() / global_scale
    scaled = blocks / torch.where(local == 0, torch.ones_like(local), local).unsqueeze(-1)
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    index = (scaled.abs().unsqueeze(-1) - table).abs().argmin(-1)
    nibbles = (index + (torch.signbit(scaled).to(torch.int64) << 3)).reshape(o, i)
    packed = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).to(torch.uint8)
    return packed, scales, global_scale.to(torch.float32)


def encode_modelopt_nvfp4(x: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    """A 2-D weight as ModelOpt stores NVFP4: (uint8 packed E2M1 [O, I/2], float8_e4m3fn `weight_scale` [O, I/16],
    F32 `weight_scale_2` []) with ModelOpt's rules (NVFP4QTensor: weight_scale_2 = amax / (6 * 448), each block's
    scale fp8(amax_block / (6 * weight_scale_2)), elements the nearest E2M1 value of x / (scale * weight_scale_2),
    even element in the low nibble)."""
    import torch

    x = x.float()
    o, i = x.shape
    scale_2 = (x.abs().amax().clamp(min=1e-12) / (6.0 * 448.0)).reshape(())
    blocks = x.reshape(o, i // 16, 16)
    scales = (blocks.abs().amax(-1) / (6.0 * scale_2)).clamp(max=448.0).to(torch.float8_e4m3fn)
    # vLLM's reference arithmetic (ref_nvfp4_quant): x times 1 / (scale * (1 / global)), global = 1 / scale_2
    step = scales.float() * (1.0 / (1.0 / scale_2))
    scaled = (blocks * torch.where(step == 0, torch.zeros_like(step), 1.0 / step).unsqueeze(-1)).clamp(-6.0, 6.0)
    return _pack_e2m1_even(scaled.reshape(o, i)), scales, scale_2.to(torch.float32)


E2M1_EVEN_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # midpoints; a tie goes to the even code (RNE)


def _pack_e2m1_even(scaled: "torch.Tensor") -> "torch.Tensor":
    """Packed E2M1 codes of already-scaled values [O, I], rounded to nearest with ties to the even code (ModelOpt's
    and vLLM's cast_to_fp4), even element in the low nibble."""
    import torch

    magnitude = scaled.abs()
    index = torch.zeros_like(magnitude, dtype=torch.int64)
    for code, bound in enumerate(E2M1_EVEN_BOUNDS, start=1):
        above = magnitude > bound if code % 2 else magnitude >= bound  # odd codes lose their ties to even ones
        index += above.to(torch.int64)
    nibbles = index + (torch.signbit(scaled).to(torch.int64) << 3)
    return (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).to(torch.uint8)


def encode_quark_mxfp8_blocks(x: "torch.Tensor", block: int = MX_BLOCK) -> tuple["torch.Tensor", "torch.Tensor"]:
    """A 2-D weight as AMD's Quark MXFP8 releases with 2-D blocks spell it (DeepSeek-V4.1-Flash-MXFP4: float8_e4m3fn
    `weight` [O, I], uint8 `weight_scale` [ceil(O/32), I/32], one E8M0 exponent per 32 x 32 block, vllm#57191)."""
    import torch

    q, scales = encode_fp8_ue8m0(x, block)
    return q, scales.view(torch.uint8)


def encode_as(kind: str, x: "torch.Tensor", block: int = 128) -> dict[str, "torch.Tensor"]:
    """A 2-D weight written in format `kind` as its release stores it: {tensor-name suffix: tensor} (the weight's
    suffix and its scales', FORMATS), under the release's scale rule (the encoders above); `block`: the square
    block of UE8M0 FP8 (128 or 32)."""
    import torch

    fmt = next((f for f in FORMATS if f.kind == kind), None)
    if kind == MXFP4:
        codes, s = encode_mxfp4_release(x)
        return {fmt.weight: codes, fmt.scale: s}
    if kind == FP8_UE8M0:
        q, s = encode_fp8_ue8m0(x, block)
        return {fmt.weight: q, fmt.scale: s}
    if kind == MXFP8:
        q, s = encode_mxfp8_release(x)
        return {fmt.weight: q, fmt.scale: s}
    if kind == CT_MXFP4:
        codes, s = encode_mxfp4_release(x)
        return {fmt.weight: codes.view(torch.uint8), fmt.scale: s.view(torch.uint8)}
    if kind == CT_NVFP4:
        codes, s, g = encode_nvfp4(x)
        return {fmt.weight: codes, fmt.scale: s, fmt.global_scale: g}
    if kind == MODELOPT_NVFP4:
        codes, s, g = encode_modelopt_nvfp4(x)
        return {fmt.weight: codes, fmt.scale: s, fmt.global_scale: g,
                ".input_scale": torch.tensor(8.0 / (6.0 * 448.0))}  # a static activation amax of 8
    if kind == QUARK_MXFP8:
        q, s = encode_quark_mxfp8_blocks(x)
        return {fmt.weight: q, fmt.scale: s}
    raise QuantError(f"no release encoder for source format {kind!r} (use one of "
                     f"{', '.join(f.kind for f in FORMATS)})")


def exact_blocks(x: "torch.Tensor", packed: "torch.Tensor", scales: "torch.Tensor") -> tuple[int, int]:
    """(blocks whose MXFP4 encoding `packed` [R, K/2] / `scales` [R, K/32] reproduces the values x [R, K] exactly,
    blocks): how much of a weight from another 4-bit format (NVFP4) went across without loss. Every scale mode of
    quant.numerics.mxfp4 is exact on a block MXFP4 can hold exactly (tests/test_nvfp4_sources.py), so the count is
    the number of such blocks."""
    import torch

    from quant.numerics import mxfp4

    r, k = x.shape
    back = mxfp4.dequantize_mxfp4(packed, scales, dtype=torch.float32).reshape(r, k // MX_BLOCK, MX_BLOCK)
    same = (back == x.float().reshape(r, k // MX_BLOCK, MX_BLOCK)).all(-1)
    return int(same.sum()), same.numel()
