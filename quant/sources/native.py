"""Planning and reading a quantized source's weights: which job each gets, and its data. A microscaled weight
(quant.sources.registry recognises it from its scale sibling) is a NativeSource; an official block-FP8 one a Source
with its `weight_scale_inv` (quant.sources.block_fp8). Every question about either is its format's to answer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quant.checkpoint import Source
from quant.errors import QuantError
from quant.sources.block_fp8 import BLOCK_FP8
from quant.sources.source_format import MICROSCALED, Encoding
from quant.sources.registry import format_named, missing_scale, recognise, scale_tensors

if TYPE_CHECKING:
    import torch

    from quant.checkpoint import Checkpoint, SourceReader

__all__ = ["MICROSCALED", "NativeSource", "is_microscaled", "native_source", "read_codes", "read_decoded",
           "read_values", "passthrough_parts", "scale_tensors", "recognise", "missing_scale", "Encoding",
           "check_config", "passes_through", "loss_account", "logical_shape"]

# compressed-tensors formats read here (compressed_tensors.config.CompressionFormat values); "dense" groups are BF16
CT_FORMATS = ("mxfp4-pack-quantized", "nvfp4-pack-quantized")


@dataclass(frozen=True)
class NativeSource(Source):
    """A weight stored microscaled: `encoding` (its source format's name) with its scale tensor (and NVFP4's global
    scale)."""

    encoding: str = ""
    scale: str = ""
    scale_file: str = ""
    block: tuple[int, int] = (1, 32)
    global_scale: str = ""
    global_scale_file: str = ""


def is_microscaled(ckpt: Checkpoint) -> bool:
    """Whether any stored weight carries the scale sibling of a microscaled format (DeepSeek-V4's `.scale`,
    MiniMax-M3's E8M0 `weight_scale_inv`, compressed-tensors' `weight_packed` + `weight_scale`)."""
    return bool(scale_tensors(ckpt.tensors))


def check_config(qc: dict[str, Any] | None, config_path: Path | str) -> None:
    """Refuse a compressed-tensors config whose formats are not the FP4 ones read here (int4 pack-quantized,
    FP8 float-quantized, sparse ...), naming config.json and the format."""
    if not qc or qc.get("quant_method") != "compressed-tensors":
        return
    formats = {qc.get("format")} | {g.get("format") for g in (qc.get("config_groups") or {}).values()
                                    if isinstance(g, dict)}
    bad = sorted(f for f in formats - {None, "dense", *CT_FORMATS} if f)
    if bad:
        raise QuantError(f"{config_path}: quantization_config format {', '.join(bad)} is not supported (compressed-"
                         f"tensors sources: {', '.join(CT_FORMATS)})")


def native_source(ckpt: Checkpoint, name: str, encoding: Encoding) -> NativeSource:
    info = ckpt.tensors[name]
    glob = encoding.global_scale
    return NativeSource(name, info.file, encoding=encoding.kind, scale=encoding.scale,
                        scale_file=ckpt.tensors[encoding.scale].file, block=encoding.block, global_scale=glob,
                        global_scale_file=ckpt.tensors[glob].file if glob else "")


def passes_through(encoding: Encoding, scheme_name: str | None) -> bool:
    """Whether a weight whose target is `scheme_name` keeps its codes and scales bit for bit: its format says
    (MXFP4 into MXFP4, E8M0-scaled FP8 into MXFP8, UE8M0 128x128 FP8 into block FP8, a Quark FP8 export into
    per-channel FP8; NVFP4 has no target of its own)."""
    return format_named(encoding.kind).passes_through(encoding, scheme_name)


def loss_account(src: NativeSource, values: torch.Tensor, parts: dict[str, torch.Tensor], scheme_name: str
                 ) -> dict[str, int]:
    """What the manifest records of a requantized native weight beyond its error (NVFP4 into MXFP4: the 32-blocks
    that went across exactly)."""
    return format_named(src.encoding).loss(values, parts, scheme_name)


def read_codes(reader: SourceReader, src: NativeSource) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored codes and scales of a native weight, as stored."""
    return reader.raw(src.file, src.name), reader.raw(src.scale_file, src.scale)


def read_decoded(reader: SourceReader, src: NativeSource) -> torch.Tensor:
    """The exact fp32 values of a native weight (decoded once, never rounded)."""
    codes, scales = read_codes(reader, src)
    glob = reader.raw(src.global_scale_file, src.global_scale) if src.global_scale else None
    encoding = Encoding(src.encoding, src.scale, src.block, ())
    where = f"{reader.ckpt.shard_path(src.file)}: tensor {src.name}"
    return format_named(src.encoding).decode(encoding, codes, scales, where, glob)


def read_values(reader: SourceReader, src: Source) -> torch.Tensor:
    """A source tensor's values: a native weight decoded exactly, a block-FP8 one decoded with its tile scales (fp32),
    anything else as stored (a slice of a fused expert tensor read alone)."""
    if isinstance(src, NativeSource):
        return read_decoded(reader, src)
    t = reader.raw(src.file, src.name, src.expert, src.rows)
    if src.scale_inv and src.scale_inv_file:
        block = format_named(BLOCK_FP8)
        encoding = Encoding(block.name, src.scale_inv, block.blocks[0], tuple(t.shape))
        return block.decode(encoding, t, reader.raw(src.scale_inv_file, src.scale_inv))
    return t


def passthrough_parts(reader: SourceReader, src: NativeSource, scheme_name: str | None = None
                      ) -> dict[str, torch.Tensor]:
    """The target's parts, bit for bit (its format's `carry`): Quark MXFP4 {weight, weight_scale} of an MXFP4
    weight, Quark MXFP8 {weight, weight_scale} of an E8M0-scaled FP8 one, block-FP8 {weight, weight_scale_inv} of a
    UE8M0 128x128 one, Quark per-channel FP8 of a Quark FP8 one."""
    codes, scales = read_codes(reader, src)
    try:
        return format_named(src.encoding).carry(codes, scales, src.block, scheme_name)
    except QuantError as e:
        raise QuantError(f"{reader.ckpt.shard_path(src.file)}: tensor {src.name}: {e}") from None


def logical_shape(ckpt: Checkpoint, src: NativeSource) -> list[int]:
    """The decoded shape of a native weight (packed FP4: two elements per stored byte)."""
    return list(format_named(src.encoding).logical_shape(tuple(ckpt.tensors[src.name].shape)))
