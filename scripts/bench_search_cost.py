"""Benchmark: `quant search --dry-run`'s predicted cost of the streamed Fisher estimate against the measured one.

For each toy (tests/data/gptq_toy/model, evals/data/toy_arith/model, and random toys built with
`quant.toy.build.build_toy`: glm5, deepseek-v3, qwen3-moe), in a fresh subprocess with one torch thread:
  1. the dry run's prediction (`quant.search.cost.search_cost`) for the windows the search will really use
     (`calibration_tokens` of tests/data/gptq_toy/calib.jsonl, 32 samples x 128 tokens, and again with 128
     samples: the growth between the two is what the calibration costs, free of the process's fixed cost);
  2. `quant.search.run.measure(src, ["vllm"], calib, sensitivity="fisher")`, timed (it includes the units, menus
     and prices, which are small beside the estimate), and the process's peak RSS (resource.getrusage maxrss)
     before and after it.
Printed per toy: predicted FLOPs, measured seconds, the implied FLOP/s, the predicted host peak against the
measured peak RSS and its rise during measure() (the process's fixed cost, torch and transformers, is not
predicted); the rise again in a process run with MALLOC_MMAP_THRESHOLD_=65536 (--mmap-threshold; 0: not run):
glibc's default raises its mmap threshold as large blocks are freed, after which the batches' tensors come from
the heap and its fragmentation adds to the peak, which the model does not predict. Then the prediction for
GLM-5.2 (tests/data/glm52_config, config.json alone) over 128 windows x 128 tokens with the releases vllm, its
reading time at --read-gbps (an assumed disk rate), and its hours at the toys' median FLOP/s over their largest
window count (this machine's CPU rate, one thread) and at an assumed GPU rate (--gpu-tflops, default 100: an
assumption about a GPU port of the estimate, about a fifth of an H100's dense TF32 peak; the estimate runs on the
CPU today).

    .venv/bin/python scripts/bench_search_cost.py [--toys gptq_toy,toy_arith,glm5,deepseek-v3,qwen3-moe]
        [--samples 32,128] [--seq-len 128] [--work /tmp/bench-search-cost] [--gpu-tflops 100] [--read-gbps 2]
        [--mmap-threshold 65536]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CALIB = ROOT / "tests/data/gptq_toy/calib.jsonl"
GLM52 = ROOT / "tests/data/glm52_config"
TRAINED = {"gptq_toy": ROOT / "tests/data/gptq_toy/model", "toy_arith": ROOT / "evals/data/toy_arith/model"}


def one(src: Path, samples: int, seq_len: int) -> dict:
    """In this (fresh) process: the prediction, then measure() timed, and the peak RSS around it."""
    import resource

    import torch

    torch.set_num_threads(1)
    from quant.gptq.calibration import CalibrationSettings, calibration_tokens
    from quant.search.cost import search_cost
    from quant.search.run import measure

    calib = CalibrationSettings(str(CALIB), samples=samples, seq_len=seq_len)
    windows = calibration_tokens(calib, src)
    cost = search_cost(src, samples=int(windows.shape[0]), seq_len=int(windows.shape[1]), engines=["vllm"])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    measure(src, ["vllm"], calib, sensitivity="fisher", log=lambda _m: None)
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    totals = cost.totals()
    return {"windows": int(windows.shape[0]), "seq_len": int(windows.shape[1]), "layers": totals["layers"],
            "passes": totals["passes"], "flops": totals["flops"], "peak_predicted": totals["peak_host_bytes"],
            "seconds": seconds, "rss_before": before, "rss_peak": after, "flops_per_s": totals["flops"] / seconds}


def toy_source(name: str, work: Path) -> Path:
    if name in TRAINED:
        return TRAINED[name]
    from quant.toy.build import build_toy

    out = work / name
    if not (out / "config.json").exists():
        build_toy(name, out)
    return out


def mib(n: float) -> str:
    return f"{n / (1 << 20):.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--toys", default="gptq_toy,toy_arith,glm5,deepseek-v3,qwen3-moe")
    parser.add_argument("--samples", default="32,128", help="calibration windows, one run each (comma-separated)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-search-cost"))
    parser.add_argument("--gpu-tflops", type=float, default=100.0)
    parser.add_argument("--read-gbps", type=float, default=2.0)
    parser.add_argument("--mmap-threshold", type=int, default=65536)
    parser.add_argument("--one", type=Path, help=argparse.SUPPRESS)  # the subprocess: one toy, JSON on stdout
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one, int(args.samples), args.seq_len)))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    counts = [int(n) for n in args.samples.split(",")]
    for name in args.toys.split(","):
        src = toy_source(name, args.work)
        for samples in counts:
            proc = subprocess.run([sys.executable, __file__, "--one", str(src), "--samples", str(samples),
                                   "--seq-len", str(args.seq_len)], capture_output=True, text=True, check=False)
            if proc.returncode:
                print(f"[{name}] failed: {proc.stderr.strip().splitlines()[-1:]}", flush=True)
                continue
            rows.append({"toy": name, **json.loads(proc.stdout.strip().splitlines()[-1])})
            if args.mmap_threshold:
                env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)}
                fixed = subprocess.run([sys.executable, __file__, "--one", str(src), "--samples", str(samples),
                                        "--seq-len", str(args.seq_len)], capture_output=True, text=True, check=True,
                                       env=env)
                again = json.loads(fixed.stdout.strip().splitlines()[-1])
                rows[-1]["rise_fixed_threshold"] = again["rss_peak"] - again["rss_before"]
            print(f"[{name}] {samples} windows: {rows[-1]['seconds']:.1f} s", flush=True)
    (args.work / "bench_search_cost.json").write_text(json.dumps(rows, indent=1))
    print()
    print("| toy | windows x tokens | layers | passes | predicted GFLOP | measured s | implied GFLOP/s "
          "| predicted peak MiB | peak RSS MiB (rise in measure) | rise, fixed mmap threshold |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['toy']} | {r['windows']} x {r['seq_len']} | {r['layers']} | {r['passes']} | "
              f"{r['flops'] / 1e9:.2f} | {r['seconds']:.1f} | {r['flops_per_s'] / 1e9:.2f} | "
              f"{mib(r['peak_predicted'])} | {mib(r['rss_peak'])} ({mib(r['rss_peak'] - r['rss_before'])}) | "
              f"{mib(r['rise_fixed_threshold']) if 'rise_fixed_threshold' in r else '-'} |")
    from quant.search.cost import render, search_cost

    cost = search_cost(GLM52, samples=128, seq_len=128, engines=["vllm"])
    rates = {}
    if rows:
        most = max(r["windows"] for r in rows)
        rates[f"this CPU, one torch thread: the toys' median at {most} windows"] = statistics.median(
            r["flops_per_s"] for r in rows if r["windows"] == most)
    rates["assumed GPU port"] = args.gpu_tflops * 1e12
    print()
    print("\n".join(render(cost, rates)))
    print(f"  reading {cost.read_bytes() / 1e9:.0f} GB at {args.read_gbps:g} GB/s (assumed): "
          f"{cost.read_bytes() / args.read_gbps / 1e9 / 3600:.2f} hours")


if __name__ == "__main__":
    main()
