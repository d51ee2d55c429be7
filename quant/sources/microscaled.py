"""Checkpoints that arrive already microscaled (DeepSeek-V4 and its kin): every quantized weight `W.weight` has a
sibling `W.scale` of E8M0 exponents, and the pair is one of

- MXFP4 (`mxfp4`): `weight` I8 (or U8) [..., R, K/2], two E2M1 codes per byte, the even element in the LOW nibble
  (torch float4_e2m1fn_x2, transformers' `_unpack_fp4`, DeepSeek's inference code); `scale` F8_E8M0 (or U8)
  [..., R, K/32], one exponent per 32 consecutive inputs. Byte b means 2^(b - 127); 0xFF is NaN.
- UE8M0 block FP8 (`fp8-ue8m0`): `weight` F8_E4M3 [O, I]; `scale` F8_E8M0 [ceil(O/b), ceil(I/b)] with b = 128
  (DeepSeek-V4 attention and shared experts) or 32 (DeepSeek-V4.1's dense layers); value = code * 2^(b - 127).

Decoding is exact: an E2M1 or E4M3 value times a power of two is an fp32 number (the only exceptions are scales
beyond fp32's range, which are refused). Quark stores MXFP4 as uint8 `weight` [R, K/2] (even element in the low
nibble, as quant/numerics/mxfp4.py packs) + uint8 `weight_scale` [R, K/32]: the same bytes, so a native MXFP4
weight headed for MXFP4 is carried over by reinterpreting its bytes (`to_quark_mxfp4`), never decoded."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from quant.errors import QuantError

if TYPE_CHECKING:
    import torch

__all__ = ["MXFP4", "FP8_UE8M0", "SCALE_SUFFIX", "Encoding", "recognise", "scale_name", "decode", "decode_mxfp4",
           "decode_fp8_ue8m0", "to_quark_mxfp4", "to_fp8_block", "scale_tensors"]

MXFP4 = "mxfp4"
FP8_UE8M0 = "fp8-ue8m0"
SCALE_SUFFIX = ".scale"
MX_BLOCK = 32
FP8_BLOCKS = (128, 32)  # DeepSeek-V4: 128x128; DeepSeek-V4.1-Flash dense layers: 32x32
CODE_DTYPES = ("I8", "U8")
E8M0_DTYPES = ("F8_E8M0", "U8")


@dataclass(frozen=True)
class Encoding:
    """How one stored weight encodes its values: `kind` (MXFP4 or FP8_UE8M0), its scale tensor, the block
    ([1, 32] for MXFP4, [b, b] for block FP8) and the logical (decoded) shape."""

    kind: str
    scale: str
    block: tuple[int, int]
    shape: tuple[int, ...]


def scale_name(weight: str) -> str | None:
    """The E8M0 scale tensor that goes with `weight` (`X.weight` -> `X.scale`), None for other names."""
    return weight[: -len(".weight")] + SCALE_SUFFIX if weight.endswith(".weight") else None


def scale_tensors(tensors) -> set[str]:
    """The names in `tensors` (name -> info with .dtype/.shape) that are the E8M0 scales of a stored weight."""
    return {s for name in tensors if (s := scale_name(name)) and s in tensors}


def recognise(tensors, weight: str, where: str = "") -> Encoding | None:
    """The Encoding of `weight` from headers alone (`tensors`: name -> info with .dtype and .shape), None when
    it has no `.scale` sibling (a plain BF16/F32 tensor, or a block-FP8 one with weight_scale_inv). A scale whose
    dtype or shape fits no known format is refused, naming both tensors."""
    scale = scale_name(weight)
    if scale is None or scale not in tensors:
        return None
    w, s = tensors[weight], tensors[scale]
    wshape, sshape = tuple(w.shape), tuple(s.shape)
    where = where or weight
    if s.dtype not in E8M0_DTYPES:
        raise QuantError(f"{where}: {scale} is {s.dtype}, expected E8M0 exponents (F8_E8M0 or U8)")
    if w.dtype in CODE_DTYPES:
        if (len(wshape) >= 2 and len(sshape) == len(wshape) and sshape[:-1] == wshape[:-1]
                and wshape[-1] * 2 == sshape[-1] * MX_BLOCK):
            return Encoding(MXFP4, scale, (1, MX_BLOCK), (*wshape[:-1], wshape[-1] * 2))
        raise QuantError(f"{where}: {weight} {w.dtype} {list(wshape)} with {scale} {list(sshape)} is not MXFP4 "
                         f"(expected a scale of shape [..., K/32] for packed codes [..., K/2])")
    if w.dtype == "F8_E4M3":
        if len(wshape) == 2 and len(sshape) == 2:
            for b in FP8_BLOCKS:
                if sshape == (math.ceil(wshape[0] / b), math.ceil(wshape[1] / b)):
                    return Encoding(FP8_UE8M0, scale, (b, b), wshape)
        raise QuantError(f"{where}: {weight} F8_E4M3 {list(wshape)} with {scale} {list(sshape)} matches no block "
                         f"size ({' or '.join(f'{b}x{b}' for b in FP8_BLOCKS)})")
    raise QuantError(f"{where}: {weight} is {w.dtype} beside E8M0 scales {scale}; expected I8/U8 MXFP4 codes or "
                     f"F8_E4M3")


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


def decode_fp8_ue8m0(q: "torch.Tensor", scales: "torch.Tensor", block: int, what: str = "FP8 weight"
                     ) -> "torch.Tensor":
    """fp32 [O, I] from float8_e4m3fn codes and E8M0 block scales [ceil(O/b), ceil(I/b)], exactly."""
    import torch

    from quant.numerics import mxfp4

    scale_bytes = _bytes(scales)
    _check_scales(scale_bytes, what)
    o, i = q.shape
    if tuple(scale_bytes.shape) != (math.ceil(o / block), math.ceil(i / block)):
        raise QuantError(f"{what}: FP8 shape {list(q.shape)} does not match scale shape {list(scale_bytes.shape)} "
                         f"for {block}x{block} blocks")
    values = mxfp4.scale_values(scale_bytes)
    full = values.repeat_interleave(block, 0)[:o].repeat_interleave(block, 1)[:, :i]
    out = q.to(torch.float32) * full
    if not bool(torch.isfinite(out).all()):
        raise QuantError(f"{what}: non-finite values (NaN codes, or an E8M0 scale beyond fp32's range)")
    return out


def decode(encoding: Encoding, weight: "torch.Tensor", scale: "torch.Tensor", what: str = "") -> "torch.Tensor":
    """The fp32 values of a stored weight and its scale tensor under `encoding`."""
    if encoding.kind == MXFP4:
        return decode_mxfp4(weight, scale, what or "MXFP4 weight")
    return decode_fp8_ue8m0(weight, scale, encoding.block[0], what or "FP8 weight")


def to_quark_mxfp4(codes: "torch.Tensor", scales: "torch.Tensor") -> dict[str, "torch.Tensor"]:
    """Quark's MXFP4 parts (uint8 `weight` [..., K/2], uint8 `weight_scale` [..., K/32]) of a native MXFP4 weight:
    the same bytes (same nibble order), reinterpreted; nothing is decoded or rounded."""
    return {"weight": _bytes(codes).clone(), "weight_scale": _bytes(scales).clone()}


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
