"""Planning and reading a microscaled source's weights (see `microscaled`): which job each gets, and its data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from quant.checkpoint import Source
from quant.sources.microscaled import (FP8_UE8M0, MXFP4, Encoding, decode, recognise, scale_tensors,
                                       to_fp8_block, to_quark_mxfp4)

if TYPE_CHECKING:
    import torch

    from quant.checkpoint import Checkpoint, SourceReader

__all__ = ["MICROSCALED", "NativeSource", "is_microscaled", "native_source", "read_codes", "read_decoded",
           "passthrough_parts", "scale_tensors", "recognise", "MXFP4", "Encoding"]

MICROSCALED = "microscaled"  # Plan.source_format of a checkpoint whose weights carry `.scale` E8M0 siblings
MXFP4_SCHEMES = ("w_mxfp4", "w_mxfp4_a_mxfp4")  # targets whose weight is stored exactly as a native MXFP4 source
FP8_BLOCK_SCHEME = "fp8-block"  # the official 128x128 block-FP8 target: F8_E4M3 + F32 weight_scale_inv


@dataclass(frozen=True)
class NativeSource(Source):
    """A weight stored microscaled: `encoding` (microscaled.MXFP4 / FP8_UE8M0) with its E8M0 `scale` tensor."""

    encoding: str = ""
    scale: str = ""
    scale_file: str = ""
    block: tuple[int, int] = (1, 32)


def is_microscaled(ckpt: "Checkpoint") -> bool:
    """Whether any stored weight carries a `.scale` sibling (DeepSeek-V4's layout)."""
    return bool(scale_tensors(ckpt.tensors))


def native_source(ckpt: "Checkpoint", name: str, encoding: Encoding) -> NativeSource:
    info = ckpt.tensors[name]
    return NativeSource(name, info.file, encoding=encoding.kind, scale=encoding.scale,
                        scale_file=ckpt.tensors[encoding.scale].file, block=encoding.block)


def passes_through(encoding: Encoding, scheme_name: str | None) -> bool:
    """A weight whose target is the format it already has keeps its codes and scales bit for bit: native MXFP4
    into MXFP4; UE8M0 128x128 FP8 into 128x128 block FP8 (its E8M0 scales written as the F32 powers of two they
    are)."""
    if encoding.kind == MXFP4:
        return scheme_name in MXFP4_SCHEMES
    return encoding.kind == FP8_UE8M0 and encoding.block == (128, 128) and scheme_name == FP8_BLOCK_SCHEME


def read_codes(reader: "SourceReader", src: NativeSource) -> tuple["torch.Tensor", "torch.Tensor"]:
    """The stored codes and E8M0 scales of a native weight, as stored."""
    return reader.raw(src.file, src.name), reader.raw(src.scale_file, src.scale)


def read_decoded(reader: "SourceReader", src: NativeSource) -> "torch.Tensor":
    """The exact fp32 values of a native weight (decoded once, never rounded)."""
    codes, scales = read_codes(reader, src)
    encoding = Encoding(src.encoding, src.scale, src.block, ())
    return decode(encoding, codes, scales, f"{reader.ckpt.shard_path(src.file)}: tensor {src.name}")


def passthrough_parts(reader: "SourceReader", src: NativeSource) -> dict[str, "torch.Tensor"]:
    """The target's parts, bit for bit: Quark MXFP4 {weight, weight_scale} of a native MXFP4 weight, or block-FP8
    {weight, weight_scale_inv} of a UE8M0 128x128 one."""
    codes, scales = read_codes(reader, src)
    return to_quark_mxfp4(codes, scales) if src.encoding == MXFP4 else to_fp8_block(codes, scales)


def logical_shape(ckpt: "Checkpoint", src: NativeSource) -> list[int]:
    """The decoded shape of a native weight (MXFP4: two elements per stored byte)."""
    shape = list(ckpt.tensors[src.name].shape)
    return shape[:-1] + [shape[-1] * 2] if src.encoding == MXFP4 else shape
