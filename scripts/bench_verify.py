"""Benchmark `quant verify-manifest` at GLM-5.2 scale (~118k tensors over 140 shards).

Writes a header-only Quark MXFP4 checkpoint (each shard is a real safetensors header `truncate`d to its full
size: sparse, no data), then times
  1. the whole verify-manifest process (a fresh interpreter, imports included) and its peak RSS,
  2. in-process: open_checkpoint (safetensors headers) and the verification on top of it,
and prints them against peers measured in the same run: json-parsing every shard header by hand (the floor
for reading headers) and safetensors' per-tensor get_slice with framework="numpy" vs "pt".

    .venv/bin/python scripts/bench_verify.py [--out DIR] [--shards 140] [--keep]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # tests/synthetic.py's builders

TARGET_S, TARGET_MB = 5.0, 500

CLI_SNIPPET = """
import sys, typer
try:
    from quant.cli import main
except Exception:  # sibling commands not written yet: run verify-manifest on its own
    from quant.commands.verify import command
    app = typer.Typer(); app.command()(command)
    sys.argv = ["verify-manifest"] + sys.argv[1:]
    main = app
else:
    sys.argv = ["quant", "verify-manifest"] + sys.argv[1:]
main()
"""


def build(out: Path, shards: int) -> tuple[int, float]:
    from synthetic import glm_moe_dsa_config, glm_moe_dsa_layout, quark_layout, write_checkpoint

    cfg = glm_moe_dsa_config(78, hidden=6144, experts=256, moe_inter=2048, inter=12288, heads=64, q_lora=2048,
                             kv_lora=512, nope=192, rope=64, v_head=256, index_heads=32, index_dim=128,
                             first_k_dense=3)
    cfg["vocab_size"] = 154880
    t = time.perf_counter()
    tensors, qcfg = quark_layout(cfg, glm_moe_dsa_layout(cfg))
    write_checkpoint(out, qcfg, tensors, shards=shards)
    return len(tensors), time.perf_counter() - t


def raw_headers(files: list[Path]) -> int:
    n = 0
    for f in files:
        with open(f, "rb") as fh:
            size = struct.unpack("<Q", fh.read(8))[0]
            n += len(json.loads(fh.read(size))) - 1
    return n


def get_slices(files: list[Path], framework: str) -> int:
    from safetensors import safe_open

    n = 0
    for f in files:
        with safe_open(str(f), framework=framework) as h:
            for k in h.keys():
                sl = h.get_slice(k)
                sl.get_dtype(), sl.get_shape()
                n += 1
    return n


def timed(fn, *args):
    """Wall seconds; CPU seconds are printed too because a shared 2-core machine makes wall time noisy."""
    t, c = time.perf_counter(), time.process_time()
    result = fn(*args)
    timed.cpu = time.process_time() - c
    return time.perf_counter() - t, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="where to write the synthetic checkpoint (default: a temp dir)")
    ap.add_argument("--shards", type=int, default=140)
    ap.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint")
    args = ap.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="bench_verify_"))
    ckpt = root / "glm52-mxfp4-headers"
    try:
        n_tensors, build_s = build(ckpt, args.shards)
        files = sorted(ckpt.glob("*.safetensors"))
        disk = sum(f.stat().st_blocks * 512 for f in files) / 2**20
        apparent = sum(f.stat().st_size for f in files) / 2**40
        print(f"checkpoint: {n_tensors} tensors in {len(files)} shards, apparent {apparent:.2f} TiB, "
              f"{disk:.1f} MiB on disk (built in {build_s:.1f}s)")

        # 1. the whole process, first child so RUSAGE_CHILDREN's max RSS is its own
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", CLI_SNIPPET, str(ckpt), "--json"], capture_output=True,
                              text=True)
        cli_s = time.perf_counter() - t
        child = resource.getrusage(resource.RUSAGE_CHILDREN)
        cli_mb, cli_cpu = child.ru_maxrss / 1024, child.ru_utime + child.ru_stime
        if proc.returncode not in (0, 1):
            raise SystemExit(f"verify-manifest failed ({proc.returncode}): {proc.stderr[-2000:]}")
        report = json.loads(proc.stdout)
        print(f"verify-manifest process: {cli_s:.2f}s wall ({cli_cpu:.2f}s CPU), peak RSS {cli_mb:.0f} MB, "
              f"exit {proc.returncode}, "
              f"{report['errors']} error(s) / {report['warnings']} warning(s) over {len(report['profiles'])} "
              f"engine profiles   [target <= {TARGET_S:.0f}s, <= {TARGET_MB} MB: "
              f"{'met' if cli_s <= TARGET_S and cli_mb <= TARGET_MB else 'MISSED'}]")

        # 2. in-process breakdown (imports already paid)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        print(f"peer process `import torch`: {time.perf_counter() - t:.2f}s wall (for scale: the preflight "
              "never imports torch; headers are read with framework='numpy')")

        from quant.checkpoint import open_checkpoint
        import quant.verify as verify

        open_s, ck = timed(open_checkpoint, ckpt)
        open_cpu = timed.cpu
        real_open = verify.open_checkpoint
        verify.open_checkpoint = lambda _path: ck
        try:
            verify_s, _ = timed(verify.verify_checkpoint, ckpt)
            verify_cpu = timed.cpu
        finally:
            verify.open_checkpoint = real_open
        raw_s, n_raw = timed(raw_headers, files)
        np_s, _ = timed(get_slices, files, "numpy")
        pt_s, _ = timed(get_slices, files, "pt")
        assert n_raw == n_tensors == len(ck.tensors)
        print(f"open_checkpoint (safetensors get_slice, framework='numpy'): {open_s:.2f}s ({open_cpu:.2f}s CPU)")
        print(f"verification after open (5 engine profiles):              {verify_s:.2f}s ({verify_cpu:.2f}s CPU)")
        print(f"peers: json header parse {raw_s:.2f}s | get_slice numpy {np_s:.2f}s | get_slice pt {pt_s:.2f}s")
        print(f"ratios: open_checkpoint / json parse = {open_s / raw_s:.1f}x; get_slice pt / numpy = "
              f"{pt_s / np_s:.1f}x; verification / json parse = {verify_s / raw_s:.1f}x")
    finally:
        if not args.keep:
            shutil.rmtree(root if args.out is None else ckpt, ignore_errors=True)


if __name__ == "__main__":
    main()
