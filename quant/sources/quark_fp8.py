"""A Quark FP8 export: float8_e4m3fn `X.weight` [O, I] with an F32 `X.weight_scale`, per tensor ([] / [1]) or per
channel ([O] / [O, 1]), a static `X.input_scale` consumed beside it; value = code * scale, one fp32 product (vLLM's
and Quark's dequantization). Headed for per-channel FP8, its codes are carried over, a per-tensor scale written once
per row."""

from __future__ import annotations

from typing import TYPE_CHECKING

from quant.errors import QuantError
from quant.sources.source_format import Encoding, SourceFormat
from quant.sources.targets import FP8_CHANNEL_SCHEME

if TYPE_CHECKING:
    import torch


def decode_fp8_scaled(q: torch.Tensor, scale: torch.Tensor, what: str = "FP8 weight") -> torch.Tensor:
    """fp32 [O, I] of an FP8 weight with an F32 per-tensor ([] / [1]) or per-channel ([O] / [O, 1]) scale: code *
    scale, one fp32 product."""
    import torch

    s = scale.to(torch.float32)
    s = s.reshape(-1, 1) if s.numel() == q.shape[0] and s.numel() > 1 else s.reshape(())
    out = q.contiguous().view(torch.float8_e4m3fn).to(torch.float32) * s
    if not bool(torch.isfinite(out).all()):
        raise QuantError(f"{what}: non-finite values (NaN codes or a non-finite scale)")
    return out


def to_quark_fp8(q: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """Quark per-channel FP8 parts (float8_e4m3fn `weight` [O, I], F32 `weight_scale` [O]) of a Quark FP8 weight: the
    same codes, a per-tensor scale written once per row (the same value for every element)."""
    import torch

    rows = q.shape[0]
    s = scale.to(torch.float32).reshape(-1)
    return {"weight": q.contiguous().view(torch.float8_e4m3fn).clone(),
            "weight_scale": (s if s.numel() == rows else s[:1].expand(rows)).contiguous().clone()}


class QuarkFp8(SourceFormat):
    """Quark's `X.weight` F8_E4M3 + `X.weight_scale` F32."""

    def decode(self, encoding: Encoding, weight: torch.Tensor, scale: torch.Tensor, what: str = "",
               global_scale: torch.Tensor | None = None) -> torch.Tensor:
        return decode_fp8_scaled(weight, scale, what or "FP8 weight")

    def passes_through(self, encoding: Encoding, scheme_name: str | None) -> bool:
        return scheme_name == FP8_CHANNEL_SCHEME

    def carry(self, codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
              scheme_name: str | None) -> dict[str, torch.Tensor]:
        return to_quark_fp8(codes, scales)
