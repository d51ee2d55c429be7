"""FP8 E4M3 (torch.float8_e4m3fn) weight quantization: per tensor, per output channel, and 128x128 blocks.

All three use the same rule on their group (tensor / row / tile): scale = amax / 448 in fp32,
q = e4m3fn(clamp(x / scale, -448, 448)) (true division, round to nearest even; the explicit clamp saturates on every
torch version), dequant w = q.float() * scale. Block FP8 is the DeepSeek-V3 / GLM checkpoint format: `weight`
float8_e4m3fn [out, in] with `weight_scale_inv` fp32 [ceil(out/128), ceil(in/128)]; partial edge tiles use only their
own elements (as the reference zero-pads them). Per-tensor/per-channel are Quark's `weight_scale` (fp32 [] / [out]).

A group whose amax is below 448 * 2^-126 (in particular an all-zero one) gets that amax instead, so the scale is the
normal fp32 2^-126 and x / scale never divides by zero: all-zero groups stay code 0 with a finite scale.
Non-finite input raises QuantError.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from quant.errors import QuantError
from quant.numerics import _native
from quant.numerics._compile import Kernel, wants_compiled

E4M3_MAX = 448.0
BLOCK = 128
_AMAX_FLOOR = E4M3_MAX * 2.0**-126


def _encode(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The element rule: e4m3fn(clamp(x / scale, +-448)), computed in fp32."""
    return torch.clamp(x.to(torch.float32) / scale, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _scale(amax: torch.Tensor) -> torch.Tensor:
    return torch.clamp(amax, min=_AMAX_FLOOR) / E4M3_MAX


def _quantize_tiles(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tiles [R, 128, TI, 128] (rows of zero-padded tiles) -> (q of the same shape, scale_inv [R, 1, TI, 1])."""
    amax = tiles.to(torch.float32).abs().amax(dim=(1, 3), keepdim=True)
    scale = _scale(amax)
    return _encode(tiles, scale), scale


def _quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, in] -> (q [R, in], scale [R, 1]), one scale per row."""
    scale = _scale(w.to(torch.float32).abs().amax(dim=-1, keepdim=True))
    return _encode(w, scale), scale


_EXAMPLE_DTYPES = (torch.bfloat16, torch.float32)  # bf16 sources, and fp32 from dequantized FP8 sources
QUANTIZE_TILES = Kernel(_quantize_tiles, dynamic_dims=(0, 2),
                        examples=lambda: [(torch.randn(2, BLOCK, 3, BLOCK).to(dt),) for dt in _EXAMPLE_DTYPES])
QUANTIZE_ROWS = Kernel(_quantize_rows, dynamic_dims=(0, 1),
                       examples=lambda: [(torch.randn(48, 96).to(dt),) for dt in _EXAMPLE_DTYPES])

# Input elements per kernel call: bounds the fp32 temporaries of the eager kernels (compiled ones have none).
_EAGER_CHUNK_ELEMENTS = 1 << 22
_COMPILED_CHUNK_ELEMENTS = 1 << 28


def _run(kernel: Kernel, x: torch.Tensor, compiled: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply a kernel over the leading dimension of x in chunks; returns (q like x, scales [R, ...])."""
    compiled = wants_compiled(x.numel(), compiled)
    per_row = max(1, x[0].numel())
    step = max(1, (_COMPILED_CHUNK_ELEMENTS if compiled else _EAGER_CHUNK_ELEMENTS) // per_row)
    if x.shape[0] <= step:
        return kernel(x, compiled=compiled)
    parts = [kernel(x[i:i + step], compiled=compiled) for i in range(0, x.shape[0], step)]
    return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])


def _check(w: torch.Tensor, what: str, min_dim: int) -> None:
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise QuantError(f"FP8 {what} quantization needs a bf16/fp16/fp32 tensor, got {w.dtype}")
    if w.dim() < min_dim:
        raise QuantError(f"FP8 {what} quantization needs at least {min_dim} dimensions, got shape {tuple(w.shape)}")


def _check_finite(scale: torch.Tensor, w: torch.Tensor) -> None:
    if not bool(torch.isfinite(scale).all()):
        bad = int((~torch.isfinite(w)).sum())
        raise QuantError(f"cannot quantize to FP8: {bad} non-finite value(s) (NaN/Inf) in tensor of shape "
                         f"{tuple(w.shape)}")


def quantize_fp8_block(w: torch.Tensor, block: int = BLOCK, *, compiled: bool | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] -> (q float8_e4m3fn [..., out, in], scale_inv fp32 [..., ceil(out/block), ceil(in/block)])."""
    _check(w, "block", 2)
    *lead, o, i = w.shape
    to, ti = math.ceil(o / block), math.ceil(i / block)
    if w.numel() == 0:
        return (torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device),
                torch.zeros(*lead, to, ti, dtype=torch.float32, device=w.device))
    x = w.reshape(-1, o, i)
    if o % block or i % block:  # zero padding leaves every tile's amax unchanged
        x = F.pad(x, (0, ti * block - i, 0, to * block - o))
    tiles = x.contiguous().view(-1, block, ti, block)
    if (block == BLOCK and tiles.dtype in (torch.bfloat16, torch.float32) and tiles.device.type == "cpu"
            and wants_compiled(tiles.numel(), compiled) is not False and _native.library() is not None):
        q, scale = _native.fp8_tiles(tiles)  # the same rule, vectorised by hand for AVX2 / AVX-512 (see _native)
    else:
        q, scale = _run(QUANTIZE_TILES, tiles, compiled)
    _check_finite(scale, w)
    q = q.view(-1, to * block, ti * block)[:, :o, :i]
    return q.reshape(w.shape).contiguous(), scale.view(*lead, to, ti)


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                         block: int = BLOCK) -> torch.Tensor:
    """Inverse of `quantize_fp8_block`: w[i, j] = q[i, j] * scale_inv[i // block, j // block], in fp32."""
    if q.dim() < 2 or scale_inv.shape != (*q.shape[:-2], math.ceil(q.shape[-2] / block),
                                          math.ceil(q.shape[-1] / block)):
        raise QuantError(f"block-FP8 weight shape {tuple(q.shape)} does not match weight_scale_inv shape "
                         f"{tuple(scale_inv.shape)} for {block}x{block} blocks")
    *lead, o, i = q.shape
    to, ti = scale_inv.shape[-2:]
    x = q.to(torch.float32).reshape(-1, o, i)
    if o % block or i % block:
        x = F.pad(x, (0, ti * block - i, 0, to * block - o))
    s = scale_inv.to(torch.float32).reshape(-1, to, 1, ti, 1)
    w = (x.view(-1, to, block, ti, block) * s).view(-1, to * block, ti * block)[:, :o, :i]
    return w.reshape(q.shape).to(dtype)


def quantize_fp8_per_channel(w: torch.Tensor, *, compiled: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] -> (q float8_e4m3fn, scale fp32 [..., out]); dequant q.float() * scale[..., None]."""
    _check(w, "per-channel", 2)
    if w.numel() == 0:
        return (torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device),
                torch.zeros(w.shape[:-1], dtype=torch.float32, device=w.device))
    q, scale = _run(QUANTIZE_ROWS, w.contiguous().view(-1, w.shape[-1]), compiled)
    _check_finite(scale, w)
    return q.view(w.shape), scale.view(w.shape[:-1])


def quantize_fp8_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w -> (q float8_e4m3fn, scale fp32 []); dequant q.float() * scale."""
    _check(w, "per-tensor", 1)
    amax = w.to(torch.float32).abs().amax() if w.numel() else torch.zeros((), device=w.device)
    scale = _scale(amax)
    _check_finite(scale, w)
    return _encode(w, scale), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Per-tensor (scale []) or per-channel (scale [..., out]) dequantization, computed in fp32."""
    s = scale.to(torch.float32)
    if s.dim() == 0 or s.shape == (1,):  # per tensor (also stored as [1])
        s = s.reshape(())
    elif s.shape == q.shape[:-1]:
        s = s.unsqueeze(-1)
    else:
        raise QuantError(f"FP8 weight shape {tuple(q.shape)} does not match weight_scale shape {tuple(scale.shape)} "
                         "(expected [] or [..., out])")
    return (q.to(torch.float32) * s).to(dtype)
