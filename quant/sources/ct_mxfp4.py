"""compressed-tensors MXFP4 (format `mxfp4-pack-quantized`, Kimi-K3's release): `X.weight_packed` U8 [O, I/2]
(compressed_tensors.compressors.nvfp4.helpers.pack_fp4_to_uint8: element 2i in the low nibble, sign in bit 3,
magnitude index into [0, .5, 1, 1.5, 2, 3, 4, 6], i.e. the E2M1 bit pattern) and `X.weight_scale` U8 [O, I/32] of
E8M0 exponents (compressors/mx_utils.py: 127 + floor(log2 scale); decompress 2^(b - 127)). The bytes are native
MXFP4's, under other names."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from quant.sources.e2m1_e8m0 import Mxfp4Codes
from quant.sources.source_format import SourceFormat
from quant.sources.mxfp4 import encode_mxfp4_release

if TYPE_CHECKING:
    import torch


def pack_quantized_mismatch(weight: str, weight_dtype: str, scale: str, scale_dtype: str) -> str:
    """Why a `weight_packed` pair of other dtypes is refused: compressed-tensors' integer formats share the names."""
    return (f"{weight} {weight_dtype} with {scale} {scale_dtype} is neither compressed-tensors MXFP4 (U8 codes, U8 "
            f"E8M0 scales) nor NVFP4 (U8 codes, F8_E4M3 scales); integer pack-quantized sources are not supported")


class CompressedTensorsMxfp4(Mxfp4Codes):
    """`X.weight_packed` + `X.weight_scale`, both U8."""

    def encode(self, x: torch.Tensor, block: int = 128) -> dict[str, torch.Tensor]:
        import torch

        # Kimi-K3's scales are QAT ones no RTN rule reproduces; the native release rule stands in for them.
        codes, scales = encode_mxfp4_release(x)
        return {self.weight: codes.view(torch.uint8), self.scale: scales.view(torch.uint8)}

    def pair_mismatch(self, weight: str, weight_dtype: str, scale: str, scale_dtype: str,
                      same_names: Sequence[SourceFormat]) -> str:
        return pack_quantized_mismatch(weight, weight_dtype, scale, scale_dtype)
