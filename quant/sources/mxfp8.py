"""MiniMax-M3's MXFP8 release (`quant_method: mxfp8`): `X.weight` F8_E4M3 [O, I] with `X.weight_scale_inv` U8 (or
F8_E8M0) E8M0 bytes, [O, I/32] ([1, 32] blocks, OCP MX) or [ceil(O/32), I/32] ([32, 32] blocks). vLLM 0.32 loads
it with its ModelOpt MXFP8 config (modelopt.py ModelOptMxFp8Config.from_config: "MiniMax-style checkpoints tag
quant_method mxfp8 + ignored_layers") after renaming weight_scale_inv to weight_scale (models/minimax_m3/*/model.py),
and decodes with `dequant_mxfp8_to_bf16` (code * 2^(s - 127)). A `weight_scale_inv` in F32 is the official
128x128 block-FP8 format instead (quant.sources.block_fp8), not this one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from quant.sources.e4m3_e8m0 import Fp8E8m0Blocks

if TYPE_CHECKING:
    import torch


def encode_mxfp8_release(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D weight as MiniMax-M3's MXFP8 release stores it: (float8_e4m3fn [O, I], uint8 E8M0 `weight_scale_inv`
    [O, I/32]) under the scale rule vLLM's and ModelOpt's MXFP8 quantizers use (e = ceil(log2(amax / 448)):
    vllm/model_executor/layers/quantization/utils/mxfp8_utils.py `_mxfp8_e4m3_quantize_torch`), not this tool's
    default ("even"), so requantizing the decoded values changes the bytes of every block whose amax lands below 256."""
    from quant.numerics import mxfp8

    return mxfp8.quantize_mxfp8(x.float(), mode="rceil")


class MiniMaxMxfp8(Fp8E8m0Blocks):
    """`X.weight` F8_E4M3 + `X.weight_scale_inv` E8M0 per [1, 32] (or [32, 32])."""

    def encode(self, x: torch.Tensor, block: int = 128) -> dict[str, torch.Tensor]:
        q, scales = encode_mxfp8_release(x)
        return {self.weight: q, self.scale: scales}
