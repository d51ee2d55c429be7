"""A Quark MXFP8 export: float8_e4m3fn `X.weight` [O, I] + uint8 E8M0 `X.weight_scale`, [O, I/32] ([1, 32]) or AMD's
per-block spelling [ceil(O/32), I/32] ([32, 32]: DeepSeek-V4.1-Flash-MXFP4, vllm#57191); a static `X.input_scale`
consumed beside it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from quant.sources.e4m3_e8m0 import MX_BLOCK, Fp8E8m0Blocks
from quant.sources.fp8_ue8m0 import encode_fp8_ue8m0

if TYPE_CHECKING:
    import torch


def encode_quark_mxfp8_blocks(x: torch.Tensor, block: int = MX_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D weight as AMD's Quark MXFP8 releases with 2-D blocks spell it: float8_e4m3fn `weight` [O, I], uint8
    `weight_scale` [ceil(O/32), I/32], one E8M0 exponent per 32 x 32 block."""
    import torch

    q, scales = encode_fp8_ue8m0(x, block)
    return q, scales.view(torch.uint8)


class QuarkMxfp8(Fp8E8m0Blocks):
    """Quark's `X.weight` + `X.weight_scale` MXFP8; written in AMD's [32, 32] spelling (the one a release ships)."""

    def encode(self, x: torch.Tensor, block: int = 128) -> dict[str, torch.Tensor]:
        q, scales = encode_quark_mxfp8_blocks(x)
        return {self.weight: q, self.scale: scales}
