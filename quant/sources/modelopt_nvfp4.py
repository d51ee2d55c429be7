"""ModelOpt NVFP4 (NVIDIA's nvidia/*-NVFP4 releases, MiniMax-M3.1-Flash's routed experts): U8 `X.weight` [O, I/2],
F8_E4M3 `X.weight_scale` [O, I/16], F32 `X.weight_scale_2` = amax / (6 * 448), a static F32 `X.input_scale` consumed
beside it (vLLM 0.32 modelopt.py ModelOptNvFp4Config, KNvfp4Static). Unlike compressed-tensors, the global scale
multiplies the local one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from quant.sources.e2m1_e4m3 import NVFP4_BLOCK, Nvfp4Codes, pack_e2m1

if TYPE_CHECKING:
    import torch

STATIC_INPUT_AMAX = 8.0  # what the toy's static activation scale stands for


def encode_modelopt_nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 2-D weight as ModelOpt stores NVFP4: (uint8 packed E2M1 [O, I/2], float8_e4m3fn `weight_scale` [O, I/16],
    F32 `weight_scale_2` []) with ModelOpt's rules (NVFP4QTensor: weight_scale_2 = amax / (6 * 448), each block's
    scale fp8(amax_block / (6 * weight_scale_2)), elements the nearest E2M1 value of x / (scale * weight_scale_2),
    even element in the low nibble)."""
    import torch

    x = x.float()
    o, i = x.shape
    scale_2 = (x.abs().amax().clamp(min=1e-12) / (6.0 * 448.0)).reshape(())
    blocks = x.reshape(o, i // NVFP4_BLOCK, NVFP4_BLOCK)
    scales = (blocks.abs().amax(-1) / (6.0 * scale_2)).clamp(max=448.0).to(torch.float8_e4m3fn)
    # vLLM's reference arithmetic (ref_nvfp4_quant): x times 1 / (scale * (1 / global)), global = 1 / scale_2
    step = scales.float() * (1.0 / (1.0 / scale_2))
    scaled = (blocks * torch.where(step == 0, torch.zeros_like(step), 1.0 / step).unsqueeze(-1)).clamp(-6.0, 6.0)
    return pack_e2m1(scaled.reshape(o, i)), scales, scale_2.to(torch.float32)


class ModelOptNvfp4(Nvfp4Codes):
    """`X.weight` + `X.weight_scale` + `X.weight_scale_2` (multiplies the local scale)."""

    global_multiplies = True

    def encode(self, x: torch.Tensor, block: int = 128) -> dict[str, torch.Tensor]:
        import torch

        codes, scales, scale_2 = encode_modelopt_nvfp4(x)
        return {self.weight: codes, self.scale: scales, self.global_scale: scale_2,
                ".input_scale": torch.tensor(STATIC_INPUT_AMAX / (6.0 * 448.0))}
