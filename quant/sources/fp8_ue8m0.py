"""UE8M0 block FP8 (DeepSeek-V4's attention and shared experts, DeepSeek-V4.1's dense layers): `X.weight` F8_E4M3
[O, I]; `X.scale` F8_E8M0 [ceil(O/b), ceil(I/b)] with b = 128, or 32 (vLLM's deepseek_v41 quant_config loads that
layout as MXFP8 with a 32x32 scale block); value = code * 2^(s - 127). A 128x128 one headed for the official block
FP8 keeps its codes, each E8M0 byte written as the F32 power of two it means."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from quant.sources.e4m3_e8m0 import Fp8E8m0Blocks, to_quark_mxfp8
from quant.sources.e8m0 import as_bytes, refuse_nan
from quant.sources.source_format import Encoding
from quant.sources.targets import FP8_BLOCK_SCHEME, MXFP8_SCHEME

if TYPE_CHECKING:
    import torch

OFFICIAL_BLOCK = (128, 128)


def encode_fp8_ue8m0(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
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


def to_fp8_block(q: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """Official block-FP8 parts (float8_e4m3fn `weight`, F32 `weight_scale_inv`) of a UE8M0 128x128 FP8 weight:
    the same E4M3 codes, each E8M0 byte written as the fp32 power of two it means (exact; 0xFF refused)."""
    import torch

    from quant.numerics import mxfp4

    scale_bytes = as_bytes(scales)
    refuse_nan(scale_bytes, "FP8 weight")
    return {"weight": q.contiguous().view(torch.float8_e4m3fn).clone(),
            "weight_scale_inv": mxfp4.scale_values(scale_bytes).clone()}


class Ue8m0BlockFp8(Fp8E8m0Blocks):
    """`X.weight` F8_E4M3 + `X.scale` E8M0 per [b, b] block."""

    def passes_through(self, encoding: Encoding, scheme_name: str | None) -> bool:
        if scheme_name == FP8_BLOCK_SCHEME:
            return encoding.block == OFFICIAL_BLOCK
        return super().passes_through(encoding, scheme_name)

    def carry(self, codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
              scheme_name: str | None) -> dict[str, torch.Tensor]:
        if scheme_name == MXFP8_SCHEME:
            return to_quark_mxfp8(codes, scales, block)
        return to_fp8_block(codes, scales)

    def encode(self, x: torch.Tensor, block: int = 128) -> dict[str, torch.Tensor]:
        q, scales = encode_fp8_ue8m0(x, block)
        return {self.weight: q, self.scale: scales}
