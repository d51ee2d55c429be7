"""Throughput of the MXFP4 / block-FP8 quantizers on one bf16 [2048, 6144] weight (seeded N(0, 0.02)).

Prints GB/s of bf16 input for each MXFP4 scale mode and for block FP8, next to two peers measured in the same run:
a bf16 `clone()` of the tensor (the memory-bandwidth ceiling) and torchao's `to_mx(..., block_size=32,
scaling_mode=FLOOR)` (if torchao is installed). Medians over interleaved rounds after a warm-up; the first call of
each compiled kernel (loading its `quant kernels build` package, or else torch.compile) is reported separately.

    python scripts/bench_numerics.py [--rows 2048] [--cols 6144] [--rounds 7] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from quant.numerics import fp8, mxfp4


def _peer_torchao():
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except Exception:  # torchao is an optional bench dependency
        return None
    return lambda x: to_mx(x, torch.float4_e2m1fn_x2, 32, scaling_mode=ScaleCalculationMode.FLOOR)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=6144)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(args.rows, args.cols, generator=gen) * 0.02).to(torch.bfloat16)
    nbytes = x.numel() * x.element_size()

    cases = {"clone (memory ceiling)": lambda: x.clone()}
    for mode in mxfp4.SCALE_MODES:
        cases[f"mxfp4 {mode}"] = lambda mode=mode: mxfp4.quantize_mxfp4(x, mode)
    cases["fp8 block 128x128"] = lambda: fp8.quantize_fp8_block(x)
    torchao = _peer_torchao()
    if torchao is not None:
        cases["torchao to_mx FLOOR"] = lambda: torchao(x)

    print(f"bf16 [{args.rows}, {args.cols}] = {nbytes / 1e6:.1f} MB, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, CPU capability {torch.backends.cpu.get_cpu_capability()} "
          "(inductor's vector ISA; ATEN_CPU_CAPABILITY=avx2 forces AVX2)")
    firsts = []
    for name, fn in cases.items():
        t0 = time.perf_counter()
        fn()
        firsts.append(f"{name} {time.perf_counter() - t0:.2f}")
        fn()
    print("first calls, s (compiled-kernel package load, else torch.compile): " + ", ".join(firsts))

    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):  # interleaved, so background load hits every case alike
        for name, fn in cases.items():
            reps = 1 if name.startswith("torchao") else 5
            fn()  # untimed: refills the caches the previous case evicted
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}

    print(f"{'case':26s} {'median ms':>10s} {'GB/s':>8s}")
    for name, t in med.items():
        print(f"{name:26s} {t * 1e3:10.2f} {nbytes / t / 1e9:8.2f}")
    even = med["mxfp4 even"]
    print(f"ratio mxfp4 even / clone throughput: {med['clone (memory ceiling)'] / even:.2f}x")
    if torchao is not None:
        print(f"ratio mxfp4 even / torchao to_mx FLOOR throughput: {med['torchao to_mx FLOOR'] / even:.1f}x")


if __name__ == "__main__":
    main()
