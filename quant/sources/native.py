"""Planning and reading a microscaled source's weights (see `microscaled`): which job each gets, and its data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from quant.checkpoint import Source
from quant.sources.microscaled import MXFP4, Encoding, decode, recognise, scale_tensors, to_quark_mxfp4

if TYPE_CHECKING:
    import torch

    from quant.checkpoint import Checkpoint, SourceReader

__all__ = ["MICROSCALED", "NativeSource", "is_microscaled", "native_source", "read_codes", "read_decoded",
           "passthrough_parts", "scale_tensors", "recognise", "MXFP4", "Encoding"]

MICROSCALED = "microscaled"  # Plan.source_format of a checkpoint whose weights carry `.scale` E8M0 siblings
MXFP4_SCHEMES = ("w_mxfp4", "w_mxfp4_a_mxfp4")  # targets whose weight is stored exactly as a native MXFP4 source


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
    """A native MXFP4 weight whose target is MXFP4 keeps its codes and scales bit for bit."""
    return encoding.kind == MXFP4 and scheme_name in MXFP4_SCHEMES


def read_codes(reader: "SourceReader", src: NativeSource) -> tuple["torch.Tensor", "torch.Tensor"]:
    """The stored codes and E8M0 scales of a native weight, as stored."""
    return reader.raw(src.file, src.name), reader.raw(src.scale_file, src.scale)


def read_decoded(reader: "SourceReader", src: NativeSource) -> "torch.Tensor":
    """The exact fp32 values of a native weight (decoded once, never rounded)."""
    codes, scales = read_codes(reader, src)
    encoding = Encoding(src.encoding, src.scale, src.block, ())
    return decode(encoding, codes, scales, f"{reader.ckpt.shard_path(src.file)}: tensor {src.name}")


def passthrough_parts(reader: "SourceReader", src: NativeSource) -> dict[str, "torch.Tensor"]:
    """Quark MXFP4 parts {weight, weight_scale} of a native MXFP4 weight, bit for bit."""
    return to_quark_mxfp4(*read_codes(reader, src))
