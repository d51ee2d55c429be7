"""MXFP8 (OCP Microscaling v1.0, E4M3 elements): OCP FP8 E4M3 elements (float8_e4m3fn: max 448, no infinities)
sharing one E8M0 scale per block of 32 along the last dimension. Layout (Quark, vLLM, SGLang): `weight` float8_e4m3fn
[..., K], `weight_scale` uint8 [..., K/32], byte b meaning 2^(b - 127); 0xFF (NaN) is never written.

Per block: amax = max |x| (fp32); shared exponent e = floor(log2(amax)) - 8 (emax of E4M3), plus one depending on the
scale mode, clamped to [-127, 127] (all-zero or fp32-subnormal blocks: byte 0x00). The modes are mxfp4.py's, with
E4M3's three mantissa bits in place of E2M1's one:
- "even" (Quark's default, `even_round`: amax + 2^(23 - 3 - 1) masked to its exponent): up when the significand of
  amax is at least 1.9375, where amax / 2^e would round to 512 at E4M3 precision;
- "floor" (OCP v1.0): never; amax / 2^e in [448, 512) saturates to 448;
- "rceil" (NVIDIA: e = ceil(log2(amax / 448))): up when the significand exceeds 1.75, so nothing ever saturates.
Elements: x * 2^-e (exact: a power of two), clamped to +-448 and rounded to nearest, ties to even (torch's E4M3 cast),
sign kept. Non-finite input raises QuantError. Pure integer / power-of-two arithmetic: no float8_e8m0fnu cast, which
rounds to nearest.
"""

from __future__ import annotations

import torch

from quant.errors import QuantError

BLOCK = 32
E4M3_MAX = 448.0
EMAX = 8  # largest power of two in E4M3's range: amax / 2^(floor(log2 amax) - 8) lies in [256, 512)
SCALE_MODES = ("even", "floor", "rceil")

# The exponent goes up by one when the 23-bit fraction field of amax is at least this value:
_ROUND_UP_FROM = {
    "floor": 1 << 23,  # never
    "even": (1 << 23) - (1 << 19),  # 1.m >= 1.9375 (Quark even_round with mbits = 3)
    "rceil": 0x600001,  # 1.m > 1.75: amax / 2^e <= 448
}


def scale_bytes(x: torch.Tensor, mode: str = "even") -> torch.Tensor:
    """E8M0 byte (uint8) per block of 32 along the last dimension of `x`."""
    if mode not in _ROUND_UP_FROM:
        raise QuantError(f"MXFP8 scale mode {mode!r} is not one of {', '.join(SCALE_MODES)}")
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    bits = blocks.abs().amax(dim=-1).view(torch.int32)
    field = (bits >> 23) & 0xFF
    byte = field - EMAX + ((bits & 0x7FFFFF) >= _ROUND_UP_FROM[mode]).to(torch.int32)
    return byte.clamp(0, 254).to(torch.uint8)  # clamp = exponent in [-127, 127]


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """2^(b - 127) as fp32 for E8M0 bytes b (byte 0 is the fp32 subnormal 2^-127)."""
    b = scales.to(torch.int32)
    return torch.where(b == 0, 1 << 22, b << 23).view(torch.float32)


def _inverse(scales: torch.Tensor) -> torch.Tensor:
    """2^(127 - b) as fp32 (byte 254 is the fp32 subnormal 2^-127)."""
    b = scales.to(torch.int32)
    return torch.where(b == 254, 1 << 22, (254 - b) << 23).view(torch.float32)


def quantize_mxfp8(x: torch.Tensor, mode: str = "even") -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 elements as float8_e4m3fn, E8M0 scale bytes as uint8 [..., K/32]) of `x` [..., K], K a multiple of 32."""
    if x.shape[-1] % BLOCK:
        raise QuantError(f"MXFP8 needs the last dimension to be a multiple of {BLOCK}, got {tuple(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise QuantError("MXFP8: the tensor holds NaN or Inf")
    scales = scale_bytes(x, mode)
    blocks = x.float().reshape(*scales.shape, BLOCK) * _inverse(scales).unsqueeze(-1)
    q = blocks.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), scales


def dequantize_mxfp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values an MXFP8 weight stands for: element x 2^(b - 127), in `dtype`."""
    blocks = q.float().reshape(*scales.shape, BLOCK) * scale_values(scales).unsqueeze(-1)
    return blocks.reshape(q.shape).to(dtype)
