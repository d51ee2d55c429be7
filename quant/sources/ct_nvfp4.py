"""compressed-tensors NVFP4 (format `nvfp4-pack-quantized`, llm-compressor's NVFP4A16 exports): `X.weight_packed` U8
[O, I/2] (E2M1 pairs as compressed-tensors MXFP4 packs them), `X.weight_scale` F8_E4M3 [O, I/16] and
`X.weight_global_scale` F32 [1]; value = code * (scale / global_scale) (quantization/lifecycle/forward_helpers.py
`_dequantize`: the local scale divided by the global one first). A static activation `X.input_global_scale` may sit
beside it; it describes activations, not the weight, and is consumed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from quant.sources.ct_mxfp4 import pack_quantized_mismatch
from quant.sources.e2m1_e4m3 import NVFP4_BLOCK, Nvfp4Codes, pack_e2m1
from quant.sources.source_format import SourceFormat

if TYPE_CHECKING:
    import torch


def encode_nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 2-D weight as compressed-tensors NVFP4: (uint8 packed E2M1 [O, I/2], float8_e4m3fn scales [O, I/16], F32
    global scale [1]) with compressed-tensors' rules: global = 448 * 6 / amax(tensor), each block's scale
    fp8(amax_block / 6 * global), elements the nearest E2M1 value of x / (scale / global) with ties to even
    (FP4_E2M1_DATA.cast_to_fp4's thresholds: 0.75 -> 1, 1.75 -> 2, 3.5 -> 4), even element in the low nibble."""
    import torch

    x = x.float()
    o, i = x.shape
    global_scale = (448.0 * 6.0 / x.abs().amax().clamp(min=1e-12)).reshape(1)
    blocks = x.reshape(o, i // NVFP4_BLOCK, NVFP4_BLOCK)
    scales = (blocks.abs().amax(-1) / 6.0 * global_scale).clamp(max=448.0).to(torch.float8_e4m3fn)
    local = scales.float() / global_scale
    scaled = blocks / torch.where(local == 0, torch.ones_like(local), local).unsqueeze(-1)
    return pack_e2m1(scaled.reshape(o, i)), scales, global_scale.to(torch.float32)


class CompressedTensorsNvfp4(Nvfp4Codes):
    """`X.weight_packed` + `X.weight_scale` + `X.weight_global_scale` (divides the local scale)."""

    def encode(self, x: torch.Tensor, block: int = 128) -> dict[str, torch.Tensor]:
        codes, scales, global_scale = encode_nvfp4(x)
        return {self.weight: codes, self.scale: scales, self.global_scale: global_scale}

    def pair_mismatch(self, weight: str, weight_dtype: str, scale: str, scale_dtype: str,
                      same_names: Sequence[SourceFormat]) -> str:
        return pack_quantized_mismatch(weight, weight_dtype, scale, scale_dtype)
