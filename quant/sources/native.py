"""Planning and reading a microscaled source's weights (see `microscaled`): which job each gets, and its data."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from quant.checkpoint import Source
from quant.errors import QuantError
from quant.sources.microscaled import (E8M0_FP8_KINDS, FP8_UE8M0, MX_KINDS, MXFP4, NVFP4_KINDS, PACKED_KINDS,
                                       QUARK_FP8, Encoding, decode, exact_blocks, missing_scale, recognise,
                                       scale_tensors,
                                       to_fp8_block, to_quark_fp8, to_quark_mxfp4, to_quark_mxfp8)

if TYPE_CHECKING:
    import torch

    from quant.checkpoint import Checkpoint, SourceReader

__all__ = ["MICROSCALED", "NativeSource", "is_microscaled", "native_source", "read_codes", "read_decoded",
           "passthrough_parts", "scale_tensors", "recognise", "missing_scale", "MXFP4", "Encoding", "check_config"]

MICROSCALED = "microscaled"  # Plan.source_format of a checkpoint whose weights are stored in a microscaled format
MXFP4_SCHEMES = ("w_mxfp4", "w_mxfp4_a_mxfp4")  # targets whose weight is stored exactly as a native MXFP4 source
MXFP8_SCHEME = "w_mxfp8_a_mxfp8"  # Quark MXFP8: F8_E4M3 weight + uint8 E8M0 weight_scale per [1, 32]
FP8_BLOCK_SCHEME = "fp8-block"  # the official 128x128 block-FP8 target: F8_E4M3 + F32 weight_scale_inv
FP8_CHANNEL_SCHEME = "fp8"  # Quark per-channel FP8: F8_E4M3 + F32 weight_scale [O]
# compressed-tensors formats read here (compressed_tensors.config.CompressionFormat values); "dense" groups are BF16
CT_FORMATS = ("mxfp4-pack-quantized", "nvfp4-pack-quantized")


@dataclass(frozen=True)
class NativeSource(Source):
    """A weight stored microscaled: `encoding` (a microscaled format kind) with its scale tensor (and NVFP4's global
    scale)."""

    encoding: str = ""
    scale: str = ""
    scale_file: str = ""
    block: tuple[int, int] = (1, 32)
    global_scale: str = ""
    global_scale_file: str = ""


def is_microscaled(ckpt: "Checkpoint") -> bool:
    """Whether any stored weight carries the scale sibling of a microscaled format (DeepSeek-V4's `.scale`,
    MiniMax-M3's E8M0 `weight_scale_inv`, compressed-tensors' `weight_packed` + `weight_scale`)."""
    return bool(scale_tensors(ckpt.tensors))


def check_config(qc: dict | None, config_path: Path | str) -> None:
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


def native_source(ckpt: "Checkpoint", name: str, encoding: Encoding) -> NativeSource:
    info = ckpt.tensors[name]
    glob = encoding.global_scale
    return NativeSource(name, info.file, encoding=encoding.kind, scale=encoding.scale,
                        scale_file=ckpt.tensors[encoding.scale].file, block=encoding.block, global_scale=glob,
                        global_scale_file=ckpt.tensors[glob].file if glob else "")


def passes_through(encoding: Encoding, scheme_name: str | None) -> bool:
    """A weight whose target is the format it already has keeps its codes and scales bit for bit: MXFP4 (native,
    compressed-tensors or a Quark export) into MXFP4; E8M0-scaled FP8 (MXFP8 [1, 32] / [32, 32], UE8M0 block FP8)
    into MXFP8, each block's scale written for every [1, 32] group it covers; UE8M0 128x128 FP8 into 128x128 block
    FP8 (its E8M0 scales written as the F32 powers of two they are); a Quark FP8 export into per-channel FP8 (a
    per-tensor scale written once per row). NVFP4 has no Quark target: it is decoded once (`exact_blocks`)."""
    if encoding.kind in MX_KINDS:
        return scheme_name in MXFP4_SCHEMES
    if encoding.kind in E8M0_FP8_KINDS and scheme_name == MXFP8_SCHEME:
        return encoding.block[1] % 32 == 0 and encoding.shape[-1] % 32 == 0
    if encoding.kind == QUARK_FP8:
        return scheme_name == FP8_CHANNEL_SCHEME
    return encoding.kind == FP8_UE8M0 and encoding.block == (128, 128) and scheme_name == FP8_BLOCK_SCHEME


def loss_account(src: NativeSource, values: "torch.Tensor", parts: dict[str, "torch.Tensor"], scheme_name: str
                 ) -> dict:
    """For an NVFP4 weight requantized to MXFP4: how many of its 32-blocks went across exactly (`exact_blocks` of
    `blocks`), beside the error the manifest records for every requantized weight. Other sources: nothing."""
    if src.encoding not in NVFP4_KINDS or scheme_name not in MXFP4_SCHEMES or values.dim() != 2:
        return {}
    exact, blocks = exact_blocks(values, parts["weight"], parts["weight_scale"])
    return {"exact_blocks": exact, "blocks": blocks}


def read_codes(reader: "SourceReader", src: NativeSource) -> tuple["torch.Tensor", "torch.Tensor"]:
    """The stored codes and scales of a native weight, as stored."""
    return reader.raw(src.file, src.name), reader.raw(src.scale_file, src.scale)


def read_decoded(reader: "SourceReader", src: NativeSource) -> "torch.Tensor":
    """The exact fp32 values of a native weight (decoded once, never rounded)."""
    codes, scales = read_codes(reader, src)
    glob = reader.raw(src.global_scale_file, src.global_scale) if src.global_scale else None
    encoding = Encoding(src.encoding, src.scale, src.block, ())
    return decode(encoding, codes, scales, f"{reader.ckpt.shard_path(src.file)}: tensor {src.name}", glob)


def passthrough_parts(reader: "SourceReader", src: NativeSource, scheme_name: str | None = None
                      ) -> dict[str, "torch.Tensor"]:
    """The target's parts, bit for bit: Quark MXFP4 {weight, weight_scale} of an MXFP4 weight, Quark MXFP8
    {weight, weight_scale} of an E8M0-scaled FP8 one, or block-FP8 {weight, weight_scale_inv} of a UE8M0 128x128
    one."""
    codes, scales = read_codes(reader, src)
    try:
        if src.encoding in MX_KINDS:
            return to_quark_mxfp4(codes, scales)
        if src.encoding == QUARK_FP8:
            return to_quark_fp8(codes, scales)
        if scheme_name == MXFP8_SCHEME:
            return to_quark_mxfp8(codes, scales, src.block)
        return to_fp8_block(codes, scales)
    except QuantError as e:
        raise QuantError(f"{reader.ckpt.shard_path(src.file)}: tensor {src.name}: {e}") from None


def logical_shape(ckpt: "Checkpoint", src: NativeSource) -> list[int]:
    """The decoded shape of a native weight (packed FP4: two elements per stored byte)."""
    shape = list(ckpt.tensors[src.name].shape)
    return shape[:-1] + [shape[-1] * 2] if src.encoding in PACKED_KINDS else shape

