"""Benchmark `quant verify-manifest --scales` (quant.verify.scales.scan_scales) on a synthetic MXFP4 checkpoint.

Writes a Quark MXFP4 checkpoint of GLM-5 shapes (hidden 6144, expert intermediate 2048; `--gb` sets the routed
experts per layer) with real data: random scale bytes in [112, 127] (as real weights give), weight bytes from a
random buffer, weights and scales interleaved in each shard as the quantizer writes them. Then times, median
of `--runs`, in the same process:
  - scan: scan_scales(dir) end to end (config, every shard header, every scale tensor read and checked), with
    its default threads (up to 4, one shard each) and with one;
  - floor, plain reads: each shard's header parsed with json and one os.pread of each scale tensor's byte
    range, one thread, no checks;
  - peer, safetensors + torch: safe_open(framework="pt").get_tensor of each scale tensor and its min/max (the
    same check the safetensors way; torch imported beforehand; get_tensor alone only maps the bytes);
each from a warm page cache and (unless `--no-cold`) after evicting the checkpoint's own pages (posix_fadvise
DONTNEED on each shard, nothing else on the machine), and prints, median and best of the runs, scan / floor and
the GB/s of checkpoint covered (checkpoint bytes / scan seconds). Last, the CLI: `quant verify-manifest` with and
without --scales (fresh processes, warm cache).

    .venv/bin/python scripts/bench_scales.py [--gb 3] [--shards 8] [--runs 3] [--out DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the synthetic checkpoint builders (tests/synthetic.py)

HIDDEN, MOE_INTER = 6144, 2048
EXPERT_BYTES = 3 * MOE_INTER * HIDDEN // 2 * (1 + 1 / 16)  # gate/up/down MXFP4 codes + E8M0 scales


def build(out: Path, gb: float, shards: int, layers: int = 4) -> tuple[int, int]:
    """(checkpoint bytes, scale bytes) of a freshly written synthetic MXFP4 checkpoint at `out`."""
    from quant.checkpoint import DTYPE_BYTES, INDEX_FILE
    from synthetic import glm_moe_dsa_config, glm_moe_dsa_layout, quark_layout

    moe_layers = layers - 1
    experts = max(2, int(gb * 1e9 / EXPERT_BYTES / moe_layers))
    cfg = glm_moe_dsa_config(layers, hidden=HIDDEN, experts=experts, moe_inter=MOE_INTER, inter=12288, heads=64,
                             q_lora=2048, kv_lora=512, nope=192, rope=64, v_head=256, index_heads=32,
                             index_dim=128, first_k_dense=1, nextn=0)
    cfg["vocab_size"] = 16384
    tensors, qcfg = quark_layout(cfg, glm_moe_dsa_layout(cfg))
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(qcfg, indent=2))
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, size=64 << 20, dtype=np.uint8).tobytes()
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map, total, scale_bytes = {}, 0, 0
    for s in range(shards):
        chunk = names[s * per:(s + 1) * per]
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for n in chunk:
            dtype, shape = tensors[n]
            size = DTYPE_BYTES[dtype] * int(np.prod(shape))
            header[n] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        with open(out / file, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            for n in chunk:
                begin, end = header[n]["data_offsets"]
                size = end - begin
                if n.endswith("weight_scale"):
                    f.write(rng.integers(112, 128, size=size, dtype=np.uint8).tobytes())
                    scale_bytes += size
                else:
                    start = int(rng.integers(0, len(noise) - min(size, len(noise)) + 1))
                    left = size
                    while left:
                        piece = noise[start:start + left] if left < len(noise) - start else noise[start:]
                        f.write(piece)
                        left -= len(piece)
                        start = 0
        weight_map.update({n: file for n in chunk})
        total += (out / file).stat().st_size
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total, scale_bytes


def scale_ranges(ckpt: Path) -> list[tuple[Path, list[tuple[int, int, str]]]]:
    """Per shard: (absolute offset, length, name) of every scale tensor, in file order."""
    out = []
    for f in sorted(ckpt.glob("*.safetensors")):
        with open(f, "rb") as fh:
            size = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(size))
        ranges = sorted((8 + size + v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0], k)
                        for k, v in header.items() if k.endswith("weight_scale"))
        out.append((f, ranges))
    return out


def floor_pread(ckpt: Path) -> int:
    """Each shard's header parsed (json) and each scale tensor's byte range read with one os.pread."""
    n = 0
    for path, rs in scale_ranges(ckpt):
        fd = os.open(path, os.O_RDONLY)
        try:
            for offset, length, _ in rs:
                n += len(os.pread(fd, length, offset))
        finally:
            os.close(fd)
    return n


def peer_safetensors(ckpt: Path) -> int:
    """The same check through safetensors + torch: safe_open(framework="pt"), get_tensor of each scale tensor and
    its min and max. get_tensor alone maps the bytes without reading them, so min/max is what reads them."""
    from safetensors import safe_open

    n = 0
    for path, rs in scale_ranges(ckpt):
        with safe_open(str(path), framework="pt") as f:
            for _, _, name in rs:
                t = f.get_tensor(name)
                n += int(t.min() == 0) + int(t.max() == 255)
    return n


def evict(ckpt: Path) -> None:
    """Drop this checkpoint's pages from the page cache (its own files only)."""
    os.sync()
    for f in ckpt.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(ckpt: Path) -> None:
    buf = bytearray(1 << 24)
    for f in ckpt.glob("*.safetensors"):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def run_times(fn, runs: int, before) -> dict[str, float]:
    """Median and fastest wall seconds of `runs` calls, `before()` ahead of each (untimed); on a shared machine
    the fastest is the least disturbed run."""
    times = []
    for _ in range(runs):
        before()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return {"median": sorted(times)[len(times) // 2], "best": min(times)}


def cli_time(ckpt: Path, scales: bool, runs: int) -> float:
    cmd = [str(REPO / ".venv" / "bin" / "quant"), "verify-manifest", str(ckpt), "--json"] + (["--scales"] if scales
                                                                                             else [])
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        times.append(time.perf_counter() - t)
        if proc.returncode not in (0, 1):
            sys.exit(f"verify-manifest failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=3.0)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--no-cold", dest="cold", action="store_false")
    args = ap.parse_args()

    work = args.out or Path(tempfile.mkdtemp(prefix="bench-scales-"))
    ckpt = work / "ckpt"
    try:
        if not ckpt.exists():
            t = time.perf_counter()
            total, scale_bytes = build(ckpt, args.gb, args.shards)
            print(f"built {ckpt}: {total / 1e9:.2f} GB, scales {scale_bytes / 1e6:.1f} MB "
                  f"(1/{total / scale_bytes:.1f} of it), {time.perf_counter() - t:.1f} s")
        else:
            total = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        import torch  # noqa: F401  (imported before timing: the safetensors floor must not pay for it)

        from quant.verify.scales import ScanStats, scan_scales

        n_tensors = sum(len(r) for _, r in scale_ranges(ckpt))
        stats = ScanStats()
        findings = scan_scales(ckpt, stats=stats)
        assert stats.tensors == n_tensors, (stats.tensors, n_tensors)
        assert not findings, findings[:3]
        print(f"{n_tensors} scale tensors, {stats.bytes / 1e6:.1f} MB, in {stats.files} shards; "
              f"{len(findings)} findings")
        modes = [("warm", lambda: warm(ckpt))] + ([("cold", lambda: evict(ckpt))] if args.cold else [])
        for mode, before in modes:
            timed = {name: run_times(fn, args.runs, before) for name, fn in (
                ("scan", lambda: scan_scales(ckpt)), ("scan1", lambda: scan_scales(ckpt, threads=1)),
                ("pread", lambda: floor_pread(ckpt)), ("st", lambda: peer_safetensors(ckpt)))}
            for stat in ("median", "best"):
                scan, scan1, pread, st = (timed[k][stat] for k in ("scan", "scan1", "pread", "st"))
                print(f"{mode} cache, {stat} of {args.runs}: scan {scan:.3f} s ({total / 1e9 / scan:.1f} GB/s of "
                      f"checkpoint), one thread {scan1:.3f} s; floor pread (one thread) {pread:.3f} s "
                      f"(scan = {scan / pread:.2f}x, one thread {scan1 / pread:.2f}x); peer safetensors+torch "
                      f"{st:.3f} s (scan = {scan / st:.2f}x)")
        base = cli_time(ckpt, False, args.runs)
        with_scales = cli_time(ckpt, True, args.runs)
        print(f"CLI, warm cache, median of {args.runs}: verify-manifest {base:.2f} s, with --scales "
              f"{with_scales:.2f} s (+{with_scales - base:.2f} s)")
    finally:
        if not args.keep and args.out is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
