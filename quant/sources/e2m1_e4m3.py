"""NVFP4 as stored (E2M1 pairs, an E4M3 scale per 16 inputs, one F32 global scale per tensor), the behaviour its
spellings share (compressed-tensors' `weight_packed` + `weight_global_scale`, ModelOpt's `weight` +
`weight_scale_2`): exact decoding in the reference's own order of operations, the one E2M1 rounding
(quant.numerics.mxfp4.e2m1_code) for writing it, and the account of a weight requantized to MXFP4: how many of its
32-blocks went across exactly. NVFP4 has no target of its own here, so it never passes through."""

from __future__ import annotations

from typing import TYPE_CHECKING

from quant.errors import QuantError
from quant.sources.e8m0 import as_bytes
from quant.sources.source_format import Encoding, SourceFormat
from quant.sources.targets import MXFP4_SCHEMES

if TYPE_CHECKING:
    import torch

NVFP4_BLOCK = 16
MX_BLOCK = 32


def decode_nvfp4(codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                 what: str = "NVFP4 weight", multiplies: bool = False) -> torch.Tensor:
    """fp32 [O, K] from packed E2M1 codes [O, K/2] (uint8), float8_e4m3fn scales [O, K/16] and the F32 global scale,
    in each reference's order of operations: compressed-tensors code * fp32(scale / global_scale)
    (forward_helpers._dequantize); ModelOpt (`multiplies`: `weight_scale_2` = amax / (6 * 448)) code *
    fp32(scale * weight_scale_2) (vLLM 0.32 quantization/utils/nvfp4_emulation_utils.py dequantize_to_dtype:
    `tensor_sf.to(float32) * global_scale`, then times the E2M1 values)."""
    import torch

    packed = as_bytes(codes)
    k = packed.shape[-1] * 2
    elements = unpack_e2m1(packed)
    g = global_scale.reshape(-1)[:1].to(torch.float32)
    block = scales.contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    local = block * g if multiplies else block / g
    out = elements * local.repeat_interleave(NVFP4_BLOCK, -1)[..., :k]
    if not bool(torch.isfinite(out).all()):
        raise QuantError(f"{what}: non-finite values (a zero or non-finite global scale, or NaN scales)")
    return out


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """The fp32 E2M1 values [..., 2K] of packed pairs [..., K] (even element in the low nibble)."""
    import torch

    from quant.numerics import mxfp4

    pairs = torch.stack([packed & 0xF, packed >> 4], dim=-1)
    return mxfp4.e2m1_values(pairs).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_e2m1(scaled: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 codes of already-scaled values [O, I] under the one E2M1 rounding (nearest, ties to even,
    saturating at 6: compressed-tensors' cast_to_fp4 and ModelOpt's/vLLM's cast_to_fp4 round the same way), the
    sign bit of each value kept, even element in the low nibble."""
    import torch

    from quant.numerics import mxfp4

    nibbles = mxfp4.e2m1_code(scaled.abs()) + (torch.signbit(scaled).to(torch.int32) << 3)
    return (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).to(torch.uint8)


def exact_blocks(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> tuple[int, int]:
    """(blocks whose MXFP4 encoding `packed` [R, K/2] / `scales` [R, K/32] reproduces the values x [R, K] exactly,
    blocks): how much of a weight from another 4-bit format (NVFP4) went across without loss. Every scale mode of
    quant.numerics.mxfp4 is exact on a block MXFP4 can hold exactly (tests/test_nvfp4_sources.py), so the count is
    the number of such blocks."""
    import torch

    from quant.numerics import mxfp4

    r, k = x.shape
    back = mxfp4.dequantize_mxfp4(packed, scales, dtype=torch.float32).reshape(r, k // MX_BLOCK, MX_BLOCK)
    same = (back == x.float().reshape(r, k // MX_BLOCK, MX_BLOCK)).all(-1)
    return int(same.sum()), same.numel()


class Nvfp4Codes(SourceFormat):
    """E2M1 pairs, E4M3 scales per 16, one F32 global scale: decoded once, requantized with its loss counted.
    `global_multiplies`: whether the global scale multiplies the local one (ModelOpt) or divides it
    (compressed-tensors)."""

    global_multiplies = False

    def decode(self, encoding: Encoding, weight: torch.Tensor, scale: torch.Tensor, what: str = "",
               global_scale: torch.Tensor | None = None) -> torch.Tensor:
        if global_scale is None:
            raise QuantError(f"{what or 'NVFP4 weight'}: no global scale")
        return decode_nvfp4(weight, scale, global_scale, what or "NVFP4 weight", multiplies=self.global_multiplies)

    def loss(self, values: torch.Tensor, parts: dict[str, torch.Tensor], scheme_name: str) -> dict[str, int]:
        if scheme_name not in MXFP4_SCHEMES or values.dim() != 2:
            return {}
        exact, blocks = exact_blocks(values, parts["weight"], parts["weight_scale"])
        return {"exact_blocks": exact, "blocks": blocks}
