"""E8M0 scale bytes (OCP MX v1.0, section 5.4: one unsigned exponent byte, 2^(b - 127), 0xFF is NaN), as every
E8M0-scaled source format stores them (F8_E8M0 or U8): their raw bytes, the NaN refusal, and a per-block value
written once per element."""

from __future__ import annotations

from typing import TYPE_CHECKING

from quant.errors import QuantError

if TYPE_CHECKING:
    import torch

E8M0_DTYPES = ("F8_E8M0", "U8")


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The stored bytes of a tensor of one-byte elements (int8 codes, float8_e8m0fnu scales), as uint8."""
    import torch

    return t.contiguous().view(torch.uint8)


def refuse_nan(scale_bytes: torch.Tensor, what: str) -> None:
    """A 0xFF scale byte means NaN: a source holding one cannot be decoded or carried over."""
    if bool((scale_bytes == 255).any()):
        raise QuantError(f"{what}: E8M0 scale byte 0xFF (NaN) in the source")


def expand(values: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """A per-block tensor [ceil(O/rb), ceil(I/cb)] written once per element [O, I]."""
    rb, cb = block
    return values.repeat_interleave(rb, 0)[: shape[0]].repeat_interleave(cb, 1)[:, : shape[1]]


def pair_mismatch(weight: str, weight_dtype: str, scale: str, scale_dtype: str, code_dtypes: dict[str, tuple[str, ...]]
                  ) -> str:
    """Why a weight beside what should be E8M0 scales is refused: the scale is no E8M0 byte, or the codes are none
    of the formats' with these names (`code_dtypes`: format name -> its code dtypes)."""
    if scale_dtype not in E8M0_DTYPES:
        return f"{scale} is {scale_dtype}, expected E8M0 exponents (F8_E8M0 or U8)"
    codes = " or ".join(f"{'/'.join(dtypes)} ({name})" for name, dtypes in code_dtypes.items())
    return f"{weight} is {weight_dtype} beside E8M0 scales {scale}; expected {codes} codes"
