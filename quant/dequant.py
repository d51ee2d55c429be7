"""Turning a quantized checkpoint back into plain BF16 that transformers loads on any machine.

This is how the eval stage runs MXFP4 and FP8 checkpoints on a CPU (weights emulated exactly, activations in
BF16), and how tests compare a quantized model's logits with the original. It reads the formats this tool
writes and the common ones it reads: Quark MXFP4 (U8 weight + U8 weight_scale), Quark FP8 (F8_E4M3 weight +
F32 weight_scale, per-tensor or per-channel), Quark MXFP8 (F8_E4M3 weight + U8 weight_scale per 32 inputs) and
official block FP8 (weight_scale_inv).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from quant.checkpoint import INDEX_FILE, load_tensors, open_checkpoint
from quant.errors import QuantError
from quant.numerics import fp8, mxfp4, mxfp8

SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale", ".output_scale")


def dequantize_module(weight: torch.Tensor, scales: dict[str, torch.Tensor], name: str,
                      dtype: torch.dtype) -> torch.Tensor:
    """One module's weight from its stored tensors (`scales`: suffix -> tensor)."""
    if "weight_scale_inv" in scales:
        return fp8.dequantize_fp8_block(weight, scales["weight_scale_inv"], dtype=dtype)
    scale = scales.get("weight_scale")
    if scale is None:
        if weight.dtype in (torch.uint8, torch.float8_e4m3fn):
            raise QuantError(f"tensor {name} is {weight.dtype} but has no weight_scale")
        return weight.to(dtype)
    if weight.dtype == torch.uint8:
        return mxfp4.dequantize_mxfp4(weight, scale, dtype=dtype)
    if weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.uint8:  # MXFP8: E8M0 bytes per 32 inputs
        return mxfp8.dequantize_mxfp8(weight, scale, dtype=dtype)
    if weight.dtype == torch.float8_e4m3fn:
        return fp8.dequantize_fp8(weight, scale, dtype=dtype)
    raise QuantError(f"tensor {name}: cannot dequantize a {weight.dtype} weight with a weight_scale")


def dequantize_state(tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Dequantize every module whose weight and scales are all in `tensors`; scale tensors are dropped."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIXES):
            continue
        if name.endswith(".weight"):
            module = name[: -len(".weight")]
            scales = {s[1:]: tensors[module + s] for s in SCALE_SUFFIXES if module + s in tensors}
            out[name] = dequantize_module(t, scales, name, dtype)
        else:
            out[name] = t
    return out


def dequantize_checkpoint(src: str | Path, out: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a plain copy of `src` in `dtype` (default BF16): same tensor names, no quantization_config."""
    src, out = Path(src), Path(out)
    ckpt = open_checkpoint(src)
    ckpt.require_intact()
    if src.resolve() == out.resolve():
        raise QuantError(f"{out}: refusing to overwrite the source checkpoint")
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, file in enumerate(ckpt.files):
        names = [t.name for t in ckpt.shard_tensors(file)]
        # Scales may sit in another shard than their weight: fetch them from wherever the index says.
        extra = [m + s for n in names if n.endswith(".weight") for m in [n[: -len(".weight")]]
                 for s in SCALE_SUFFIXES if m + s in ckpt.tensors and ckpt.tensors[m + s].file != file]
        tensors = load_tensors(ckpt.shard_path(file), names)
        for name in extra:
            tensors.update(load_tensors(ckpt.shard_path(ckpt.tensors[name].file), [name]))
        plain = {k: v.contiguous() for k, v in dequantize_state(tensors, dtype).items() if k in names}
        shard = f"model-{i + 1:05d}-of-{len(ckpt.files):05d}.safetensors"
        save_file(plain, str(out / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in plain})
    with open(out / INDEX_FILE, "w") as f:
        json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    config = {k: v for k, v in ckpt.config.items() if k != "quantization_config"}
    config["dtype"] = str(dtype).replace("torch.", "")
    with open(out / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", INDEX_FILE) \
                and not f.name.startswith("."):
            shutil.copy2(f, out / f.name)
    return out

