"""DeepSeek-V4's native MXFP4 (its routed experts): `X.weight` I8 (or U8) [..., R, K/2], two E2M1 codes per byte,
the even element in the LOW nibble (torch float4_e2m1fn_x2, transformers' `_unpack_fp4`, DeepSeek's inference code);
`X.scale` F8_E8M0 (or U8) [..., R, K/32], one exponent per 32 consecutive inputs. Byte b means 2^(b - 127); 0xFF is
NaN."""

from __future__ import annotations

from typing import TYPE_CHECKING

from quant.sources.e2m1_e8m0 import Mxfp4Codes

if TYPE_CHECKING:
    import torch


def encode_mxfp4_release(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [..., K] as a release stores native MXFP4: (int8 codes [..., K/2], float8_e8m0fnu scales
    [..., K/32]). The scale rule is one above OCP's floor (amax / 2^e in [2, 4): no element ever saturates, the
    top codes unused), elements rounded to nearest-even under it (quant.numerics.mxfp4's one rounding);
    `quantize_mxfp4` (any mode) picks a smaller exponent for almost every block, so a tool that decodes and
    re-rounds a native source is caught changing it."""
    import torch

    from quant.numerics import mxfp4

    _, floor = mxfp4.quantize_mxfp4(x, mode="floor")
    scales = (floor.to(torch.int32) + 1).clamp(max=254).to(torch.uint8)
    codes = mxfp4.encode_with_scales(x, scales)
    return codes.view(torch.int8), scales.view(torch.float8_e8m0fnu)


class NativeMxfp4(Mxfp4Codes):
    """DeepSeek-V4's `X.weight` + `X.scale` MXFP4."""

    def shape_mismatch(self, logical: tuple[int, ...]) -> str:
        return "is not MXFP4 (expected a scale of shape [..., K/32] for packed codes [..., K/2])"

    def encode(self, x: torch.Tensor, block: int = 128) -> dict[str, torch.Tensor]:
        codes, scales = encode_mxfp4_release(x)
        return {self.weight: codes, self.scale: scales}
