"""Official block FP8, the most common quantized source (DeepSeek-V3/R1, GLM-5; DeepSeek-V3's README_WEIGHTS.md):
`X.weight` F8_E4M3 [O, I] with `X.weight_scale_inv` F32 [ceil(O/128), ceil(I/128)], one scale per 128x128 tile
(the name says inverse, the value multiplies: w = code * scale_inv), declared by config.json's `quant_method: fp8`
with `weight_block_size: [128, 128]`. Unlike the microscaled formats it is recognised per checkpoint (its config),
then per weight (every F8_E4M3 weight needs its F32 tile scales); a weight is decoded exactly once, never carried
over (requantizing to 128x128 blocks is how a block-FP8 target is written)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from quant.errors import QuantError
from quant.sources.source_format import Encoding, Headers, SourceFormat

if TYPE_CHECKING:
    import torch

BLOCK_FP8 = "fp8-block"  # its name in the data file, and Plan.source_format of a checkpoint in it
BLOCK = (128, 128)
METHOD = "fp8"  # quantization_config.quant_method of a block-FP8 checkpoint


class BlockFp8(SourceFormat):
    """`X.weight` F8_E4M3 + `X.weight_scale_inv` F32 per 128x128 tile."""

    def declared_by(self, quantization_config: dict[str, object] | None, config_path: Path | str) -> bool:
        """Whether a checkpoint's quantization_config declares block FP8; any block but 128x128 is refused."""
        qc = quantization_config or {}
        block = qc.get("weight_block_size")
        if qc.get("quant_method") != METHOD or not block:
            return False
        if list(block) != list(BLOCK):  # type: ignore[call-overload]
            raise QuantError(f"{config_path}: quantization_config.weight_block_size {block} is not supported "
                             f"(only [128, 128])")
        return True

    def recognise(self, tensors: Headers, weight: str, where: str = "") -> Encoding | None:
        """The Encoding of an F8_E4M3 weight from its F32 tile scales (None for a weight of another dtype); a missing
        scale, or one of another dtype or grid, is refused."""
        where = where or weight
        info = tensors[weight]
        if info.dtype not in self.code_dtypes:
            return None
        module = weight[: -len(self.weight)]
        scale = module + self.scale
        if scale not in tensors:
            raise QuantError(f"{where}: tensor {weight} is F8_E4M3 but {scale} is missing")
        s = tensors[scale]
        want = tuple(-(-d // b) for d, b in zip(info.shape[-2:], BLOCK))
        if s.dtype not in self.scale_dtypes or tuple(s.shape) != want:
            raise QuantError(f"{where}: tensor {scale} is {s.dtype} {list(s.shape)}, expected F32 {list(want)} for a "
                             f"128x128 block-FP8 weight of shape {list(info.shape)}")
        return Encoding(self.name, scale, BLOCK, tuple(info.shape), module)

    def decode(self, encoding: Encoding, weight: torch.Tensor, scale: torch.Tensor, what: str = "",
               global_scale: torch.Tensor | None = None) -> torch.Tensor:
        import torch

        from quant.numerics import fp8

        return fp8.dequantize_fp8_block(weight, scale, dtype=torch.float32)

    def encode(self, x: torch.Tensor, block: int = 128) -> dict[str, torch.Tensor]:
        from quant.numerics import fp8

        q, scale_inv = fp8.quantize_fp8_block(x)
        return {self.weight: q, self.scale: scale_inv}
