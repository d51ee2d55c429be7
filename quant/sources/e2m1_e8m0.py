"""MXFP4 as stored (OCP MX v1.0: E2M1 elements, one E8M0 exponent per 32 consecutive inputs), the behaviour every
MXFP4 source format shares whatever it names its tensors (DeepSeek-V4's `.scale`, compressed-tensors'
`weight_packed`, a Quark export): exact decoding, and into an MXFP4 target its bytes carried over as they are
(Quark stores the same bytes: uint8 pairs, even element in the low nibble, uint8 E8M0 scales)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from quant.errors import QuantError
from quant.sources.e8m0 import as_bytes, pair_mismatch, refuse_nan
from quant.sources.source_format import Encoding, SourceFormat
from quant.sources.targets import MXFP4_SCHEMES

if TYPE_CHECKING:
    import torch


def decode_mxfp4(codes: torch.Tensor, scales: torch.Tensor, what: str = "MXFP4 weight") -> torch.Tensor:
    """fp32 [..., K] from packed codes [..., K/2] (int8 or uint8) and E8M0 scales [..., K/32] (float8_e8m0fnu or
    uint8), exactly."""
    import torch

    from quant.numerics import mxfp4

    packed, scale_bytes = as_bytes(codes), as_bytes(scales)
    refuse_nan(scale_bytes, what)
    out = mxfp4.dequantize_mxfp4(packed, scale_bytes, dtype=torch.float32)
    if not bool(torch.isfinite(out).all()):
        raise QuantError(f"{what}: values beyond fp32's range (E8M0 scale too large)")
    return out


def to_quark_mxfp4(codes: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """Quark's MXFP4 parts (uint8 `weight` [..., K/2], uint8 `weight_scale` [..., K/32]) of an MXFP4 weight: the
    same bytes (same nibble order), reinterpreted; nothing is decoded or rounded. A 0xFF (NaN) scale is refused,
    as decoding refuses it."""
    scale_bytes = as_bytes(scales)
    refuse_nan(scale_bytes, "MXFP4 weight")
    return {"weight": as_bytes(codes).clone(), "weight_scale": scale_bytes.clone()}


class Mxfp4Codes(SourceFormat):
    """E2M1 pairs with E8M0 scales per [1, 32]: decoded exactly, carried over bit for bit into MXFP4."""

    def decode(self, encoding: Encoding, weight: torch.Tensor, scale: torch.Tensor, what: str = "",
               global_scale: torch.Tensor | None = None) -> torch.Tensor:
        return decode_mxfp4(weight, scale, what or "MXFP4 weight")

    def passes_through(self, encoding: Encoding, scheme_name: str | None) -> bool:
        return scheme_name in MXFP4_SCHEMES

    def carry(self, codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
              scheme_name: str | None) -> dict[str, torch.Tensor]:
        return to_quark_mxfp4(codes, scales)

    def pair_mismatch(self, weight: str, weight_dtype: str, scale: str, scale_dtype: str,
                      same_names: Sequence[SourceFormat]) -> str:
        return pair_mismatch(weight, weight_dtype, scale, scale_dtype, {f.name: f.code_dtypes for f in same_names})
