"""Benchmark: what quantize's scale scan before the first byte costs (issue #49; quant.validate.require_sound_scales).

On the GLM-5-shaped synthetic source of scripts/bench_quantize.py (BF16, --gb GB) and on two microscaled sources
made from it (this tool's MXFP4 export and its block-FP8-shaped MXFP8 export, each used as a source again), it
reports the scan's bytes read (against the source's bytes), its seconds from a warm page cache and after the
source's pages are dropped (posix_fadvise DONTNEED, where the kernel honours it), and a whole `quantize` run of that
source with the scan's own seconds inside it (manifest timing `scale_scan_s`): what the run costs without it is the
difference. The figures go in BENCHMARKS.md with the command.

    .venv/bin/python scripts/bench_scale_scan.py [--gb 3] [--shards 8] [--keep DIR]
    .venv/bin/python scripts/bench_scale_scan.py --hub    # toys served by tests/hub_server.py: bytes over HTTP
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quantize import build_synthetic, settle  # noqa: E402

from quant.checkpoint import open_checkpoint  # noqa: E402
from quant.pipeline import quantize_checkpoint  # noqa: E402
from quant.validate import require_sound_scales  # noqa: E402


def drop_pages(src: Path) -> bool:
    """Ask the kernel to drop the source's cached pages; whether it says it did (a container may ignore it)."""
    ok = True
    for f in src.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            ok = False
        finally:
            os.close(fd)
    return ok


def scan(src: Path, cold: bool) -> tuple[float, int, int]:
    """(seconds, bytes read, tensors read) of one scan of `src`, opening it included."""
    settle(src)
    if cold:
        drop_pages(src)
    start = time.perf_counter()
    stats = require_sound_scales(open_checkpoint(src), log=lambda *a: None)
    return time.perf_counter() - start, stats.bytes, stats.tensors


HUB_PROBE = """
import json, sys, time
from quant.hub import hub_reference, open_hub_checkpoint
from quant.validate import require_sound_scales
for toy in sys.argv[1:]:
    hub = open_hub_checkpoint(hub_reference("org/" + toy))
    headers, requests = hub.traffic.bytes, hub.traffic.requests
    started = time.perf_counter()
    stats = require_sound_scales(hub, log=lambda *a: None)
    print(json.dumps({"toy": toy, "repo_bytes": hub.repo_bytes(), "headers_bytes": headers,
                      "headers_requests": requests, "scan_bytes": hub.traffic.bytes - headers,
                      "scan_requests": hub.traffic.requests - requests, "scale_bytes": stats.bytes,
                      "scan_s": round(time.perf_counter() - started, 3)}))
    hub.close()
"""
HUB_TOYS = ("deepseek-v4", "kimi-k3", "minimax-m3.1-flash", "glm5")


def hub_rows(work: Path) -> list[dict]:
    """The scan of sharded toys served by tests/hub_server.py, read by huggingface_hub's client in a subprocess:
    bytes and requests of the plan's headers and of the scan itself."""
    import subprocess

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from hub_server import HubServer

    from quant.toy import build_toy

    server = HubServer().start()
    try:
        for toy in HUB_TOYS:
            server.add_repo(f"org/{toy}", build_toy(toy, work / f"hub-{toy}", shard_size="300KB"), content_sha=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
        env.update(HF_ENDPOINT=server.url, HF_HUB_OFFLINE="0", HF_HOME=str(work / "hf-home"), HF_HUB_DISABLE_XET="1")
        run = subprocess.run([sys.executable, "-c", HUB_PROBE, *HUB_TOYS], env=env, capture_output=True, text=True,
                             check=True)
    finally:
        server.stop()
    return [json.loads(line) for line in run.stdout.splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=3.0)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--keep", type=Path)
    ap.add_argument("--hub", action="store_true", help="measure the scan of toys over HTTP instead")
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-scan-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.hub:
        for r in hub_rows(work):
            print(f"{r['toy']:>18}: repository {r['repo_bytes'] / 1e6:.2f} MB; "
                  f"headers {r['headers_bytes'] / 1e3:.1f} kB "
                  f"in {r['headers_requests']} requests; scan {r['scan_bytes'] / 1e3:.1f} kB in {r['scan_requests']} "
                  f"requests ({r['scale_bytes'] / 1e3:.1f} kB of scales), {r['scan_s']:.2f} s")
        if args.keep is None:
            shutil.rmtree(work)
        return
    bf16 = work / "bf16"
    if not bf16.exists():
        build_synthetic(bf16, args.gb, args.shards)
    sources = {"bf16": bf16}
    for scheme, name in (("w_mxfp4_a_mxfp4", "mxfp4-export"), ("w_mxfp8_a_mxfp8", "mxfp8-export")):
        if not (work / name).exists():
            quantize_checkpoint(bf16, work / name, scheme=scheme, check_engines=[], log=lambda *a: None)
        sources[name] = work / name
    rows = []
    for label, src in sources.items():
        size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        warm = [scan(src, cold=False) for _ in range(args.runs)]
        cold = [scan(src, cold=True) for _ in range(args.runs)]
        runs = []
        for i in range(args.runs):
            out = work / f"out-{label}-{i}"
            shutil.rmtree(out, ignore_errors=True)
            settle(src)
            started = time.perf_counter()
            manifest = quantize_checkpoint(src, out, check_engines=[], log=lambda *a: None)
            runs.append((time.perf_counter() - started, manifest["timing"]["scale_scan_s"]))
            shutil.rmtree(out)
        total = statistics.median(r[0] for r in runs)
        in_run = statistics.median(r[1] for r in runs)
        rows.append({"source": label, "source_bytes": size, "scan_bytes": warm[0][1], "scan_tensors": warm[0][2],
                     "share_of_source": warm[0][1] / size, "scan_s_warm": statistics.median(w[0] for w in warm),
                     "scan_s_dropped": statistics.median(c[0] for c in cold), "quantize_s": total,
                     "scan_s_in_run": in_run, "scan_share_of_run": in_run / total})
    for r in rows:
        print(f"{r['source']:>13}: {r['source_bytes'] / 1e9:.2f} GB; scan reads {r['scan_tensors']} tensors, "
              f"{r['scan_bytes'] / 1e6:.2f} MB ({100 * r['share_of_source']:.2f}% of the source) in "
              f"{r['scan_s_warm']:.3f} s warm, {r['scan_s_dropped']:.3f} s after DONTNEED; "
              f"quantize {r['quantize_s']:.1f} s, "
              f"of which the scan {r['scan_s_in_run']:.3f} s ({100 * r['scan_share_of_run']:.2f}%)")
    print(json.dumps(rows))
    if args.keep is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
