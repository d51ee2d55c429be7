"""FP8 E4M3 codes with E8M0 scales over [rb, cb] blocks, the behaviour every such source format shares: MXFP8
([1, 32] per OCP MX, or the [32, 32] spelling), UE8M0 block FP8 (DeepSeek-V3.2/V4's `scale_fmt: ue8m0`). Decoding is
exact (an E4M3 value times a power of two is an fp32 number); into MXFP8 the codes are carried over, each block's
scale written for every [1, 32] group it covers, so every element keeps its scale."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from quant.errors import QuantError
from quant.sources.e8m0 import as_bytes, expand, pair_mismatch, refuse_nan
from quant.sources.source_format import Encoding, SourceFormat
from quant.sources.targets import MXFP8_SCHEME

if TYPE_CHECKING:
    import torch

MX_BLOCK = 32


def decode_fp8_ue8m0(q: torch.Tensor, scales: torch.Tensor, block: int | tuple[int, int],
                     what: str = "FP8 weight") -> torch.Tensor:
    """fp32 [O, I] from float8_e4m3fn codes and E8M0 scales over [rb, cb] blocks ([ceil(O/rb), ceil(I/cb)]; an int
    b means [b, b]), exactly: UE8M0 block FP8 and MXFP8 ([1, 32] / [32, 32])."""
    import torch

    from quant.numerics import mxfp4

    rb, cb = (block, block) if isinstance(block, int) else tuple(block)
    scale_bytes = as_bytes(scales)
    refuse_nan(scale_bytes, what)
    o, i = q.shape
    if tuple(scale_bytes.shape) != (math.ceil(o / rb), math.ceil(i / cb)):
        raise QuantError(f"{what}: FP8 shape {list(q.shape)} does not match scale shape {list(scale_bytes.shape)} "
                         f"for {rb}x{cb} blocks")
    out = q.contiguous().view(torch.float8_e4m3fn).to(torch.float32) * expand(mxfp4.scale_values(scale_bytes),
                                                                             (rb, cb), (o, i))
    if not bool(torch.isfinite(out).all()):
        raise QuantError(f"{what}: non-finite values (NaN codes, or an E8M0 scale beyond fp32's range)")
    return out


def to_quark_mxfp8(q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Quark's MXFP8 parts (float8_e4m3fn `weight` [O, I], uint8 `weight_scale` [O, I/32]) of an FP8 weight with E8M0
    scales over [rb, cb] blocks (cb a multiple of 32): the same E4M3 codes, each scale byte written for every [1, 32]
    group its block covers, so every element keeps its scale; nothing is decoded or rounded."""
    import torch

    rb, cb = block
    o, i = q.shape
    if cb % MX_BLOCK or i % MX_BLOCK:
        raise QuantError(f"FP8 weight {list(q.shape)} with {rb}x{cb} blocks cannot be written as MXFP8 [1, 32]")
    scale_bytes = as_bytes(scales)
    refuse_nan(scale_bytes, "FP8 weight")
    per_group = scale_bytes.repeat_interleave(rb, 0)[:o].repeat_interleave(cb // MX_BLOCK, 1)[:, : i // MX_BLOCK]
    return {"weight": q.contiguous().view(torch.float8_e4m3fn).clone(), "weight_scale": per_group.contiguous().clone()}


class Fp8E8m0Blocks(SourceFormat):
    """E4M3 codes with E8M0 scales over [rb, cb] blocks: decoded exactly, carried over into MXFP8 when every block
    is a whole number of [1, 32] groups."""

    def decode(self, encoding: Encoding, weight: torch.Tensor, scale: torch.Tensor, what: str = "",
               global_scale: torch.Tensor | None = None) -> torch.Tensor:
        return decode_fp8_ue8m0(weight, scale, encoding.block, what or "FP8 weight")

    def passes_through(self, encoding: Encoding, scheme_name: str | None) -> bool:
        return scheme_name == MXFP8_SCHEME and encoding.block[1] % MX_BLOCK == 0 and encoding.shape[-1] % MX_BLOCK == 0

    def carry(self, codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
              scheme_name: str | None) -> dict[str, torch.Tensor]:
        return to_quark_mxfp8(codes, scales, block)

    def pair_mismatch(self, weight: str, weight_dtype: str, scale: str, scale_dtype: str,
                      same_names: Sequence[SourceFormat]) -> str:
        return pair_mismatch(weight, weight_dtype, scale, scale_dtype, {f.name: f.code_dtypes for f in same_names})
