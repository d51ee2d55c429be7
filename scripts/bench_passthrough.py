"""Passthrough vs requantize for a DeepSeek-V4 source (issue #31): `quant quantize` on the deepseek-v4 toy, whose
routed experts are native MXFP4 (carried over bit for bit), against the same model as a BF16 source (the exact
decode of every microscaled tensor) quantized with the same scheme and recipe: the work a tool without
passthrough does; and the native source with passthrough switched off (each expert decoded and re-rounded). The BF16
copy is written before timing; both exports skip the engine self-check.

    .venv/bin/python scripts/bench_passthrough.py [--experts 16 --hidden 256 --inter 512 --runs 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def bf16_copy(src: Path, dst: Path) -> None:
    """The same weights as a plain BF16 checkpoint: every microscaled tensor decoded exactly, `.scale` dropped."""
    import torch
    from safetensors.torch import load_file, save_file

    from quant.checkpoint import open_checkpoint
    from quant.sources.registry import decode, recognise, scale_tensors

    ckpt = open_checkpoint(src)
    tensors = {}
    for f in ckpt.files:
        tensors.update(load_file(src / f))
    scales = scale_tensors(ckpt.tensors)
    out = {}
    for name, value in tensors.items():
        if name in scales:
            continue
        enc = recognise(ckpt.tensors, name)
        out[name] = decode(enc, value, tensors[enc.scale]).to(torch.bfloat16) if enc else value
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / extra).exists():
            shutil.copy(src / extra, dst / extra)


def timed_export(src: Path, root: Path, scheme: str, tag: str, passthrough: bool = True) -> tuple[float, dict]:
    from quant.pipeline import quantize_checkpoint
    from quant.sources import native

    out = root / tag
    shutil.rmtree(out, ignore_errors=True)
    keep = native.passes_through
    if not passthrough:  # the same native source, every MXFP4 expert decoded and re-rounded by our RTN
        native.passes_through = lambda encoding, scheme_name: False
    try:
        t0 = time.perf_counter()
        manifest = quantize_checkpoint(src, out, scheme=scheme, check_engines="", log=lambda *a, **k: None)
        return time.perf_counter() - t0, manifest
    finally:
        native.passes_through = keep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--inter", type=int, default=512)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--scheme", default="w_mxfp4_a_mxfp4")
    args = parser.parse_args()

    from quant.toy import build_toy

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        src = build_toy("deepseek-v4", root / "native", overrides={
            "n_routed_experts": args.experts, "hidden_size": args.hidden, "moe_intermediate_size": args.inter})
        native = sum(p.stat().st_size for p in src.glob('*.safetensors'))
        print(f"toy: {time.perf_counter() - t0:.1f} s to build; {native / 1e6:.1f} MB native")
        bf16_copy(src, root / "bf16")
        print(f"bf16 copy: {(root / 'bf16' / 'model.safetensors').stat().st_size / 1e6:.1f} MB")
        rows = {"passthrough (native MXFP4 source)": [], "requantize (native source, decode + RTN)": [],
                "requantize (BF16 copy, RTN)": []}
        actions = {}
        for _ in range(args.runs):
            for (label, times), source, tag, passthrough in zip(
                    rows.items(), (src, src, root / "bf16"), ("pt", "rq", "bf"), (True, False, True)):
                seconds, manifest = timed_export(source, root, args.scheme, tag, passthrough)
                times.append(seconds)
                counts = {}
                for rec in manifest["tensors"].values():
                    counts[rec["action"]] = counts.get(rec["action"], 0) + 1
                actions[label] = counts
        for label, times in rows.items():
            print(f"{label:36s} median {statistics.median(times):6.2f} s  best {min(times):6.2f} s  "
                  f"actions {actions[label]}")
        base = statistics.median(rows["passthrough (native MXFP4 source)"])
        for label in list(rows)[1:]:
            print(f"{label} / passthrough (median): {statistics.median(rows[label]) / base:.2f}x")


if __name__ == "__main__":
    main()
