"""Benchmark: GPTQ on 1, 2 and 4 CPU ranks (torch.distributed, gloo) on one GLM-5-shaped MoE layer (issue #34).

The layer: GLM-5.2's layout (MLA attention with the DSA indexer, routed experts top-k, one shared expert) with every
width of tests/data/glm52_config divided by --scale (hidden 6144 / 8 = 768, experts [256, 768], 8 heads), --experts
routed experts (top-8 of 64 by default) and one decoder layer, fp32 on CPU, `--method gptq` with the default
experts-only recipe, --samples x --seq-len calibration tokens of tests/data/gptq_toy/calib.jsonl. Each rank count
runs the real command as separate processes: `python -m quant quantize` for one, `python -m torch.distributed.run
--standalone --nproc-per-node N -m quant quantize` for N, every process on --threads intra-op threads
(OMP_NUM_THREADS). Printed per rank count, from each rank's own record (the JSON file each rank writes as its run
ends: QUANT_GPTQ_TIMING with tests/gptq_faults on PYTHONPATH, whose sitecustomize installs quant.gptq.progress's
wrapper of `report_run` in every rank; the package writes none of its own): wall time, and per phase the slowest rank's
seconds and CPU seconds (the layer forward that feeds the next layer; the Hessians: the calibration forward of the
layer with its inputs recorded, then their accumulation at the owners; the solves; the collectives, including
waiting for a slower rank) with the speed-up of each phase over one process, and the bytes the ranks sent; whether
the export is byte-identical to one process's. At this scale the solve groups are coarse (`schedule.solve_groups`:
gate_up's 64 experts in groups of 26, down's in one, so a layer has seven units to share with the shared expert's
three linears), while GLM-5.2's are one expert each: the extrapolation balances GLM-5.2's own units. "apply" (every
rank replacing the whole layer's weights by their solved values) is not shared. --repeat N keeps each phase's least
time over N runs.

Then GLM-5.2 on --gpus devices (76 MoE layers with the MTP layer, 256 routed + 1 shared experts, top-8, the
default 128 x 2048 calibration tokens, experts-only), recomputed from these measurements (`extrapolate`, its
assumptions printed with it).

    .venv/bin/python scripts/bench_gptq_ranks.py [--ranks 1,2,4] [--scale 8] [--experts 64] [--samples 32]
        [--seq-len 128] [--threads 1] [--repeat 1] [--gpus 8] [--gpu-speedup F] [--link-gbs 10]
        [--work /tmp/bench-gptq-ranks]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CALIB = REPO / "tests" / "data" / "gptq_toy" / "calib.jsonl"
PHASES = ("forward", "hessians", "solve", "apply", "comm")  # the phases compared (quant.gptq.run.PHASES, shortened)


def _peers():
    """scripts/bench_gptq_peers.py, whose GLM-5-shaped one-layer toy (`layer_toy`) and GLM-5.2 config this uses."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gptq_peers", REPO / "scripts" / "bench_gptq_peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timing_env(prefix: Path) -> dict:
    """The environment additions that make each rank of a run write PREFIX.RANK, its timing record (as JSON): the
    hook tests/gptq_faults/sitecustomize.py installs in every process started with them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gptq_hooks", REPO / "tests" / "gptq_faults" / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.timing_env(prefix)


def glm52_config() -> dict:
    return _peers().glm52_config()


def layer_toy(work: Path, scale: int, experts: int) -> tuple[Path, dict]:
    """One GLM-5-shaped MoE decoder layer, GLM-5.2's widths and head counts divided by `scale`."""
    return _peers().layer_toy(work, experts, scale)


def run(src: Path, out: Path, ranks: int, args) -> dict:
    """One run of the command on `ranks` processes: its wall time; per phase the slowest rank's seconds and CPU
    seconds (each rank's own record, `timing_env`); the bytes all ranks sent."""
    shutil.rmtree(out, ignore_errors=True)
    prefix = out.parent / f"timing-{ranks}"
    for old in out.parent.glob(f"{prefix.name}.*"):
        old.unlink()
    cmd = ["quantize", str(src), str(out), "--method", "gptq", "--calib-data", str(CALIB), "--calib-samples",
           str(args.samples), "--calib-seq-len", str(args.seq_len), "--check-engines", "", "--no-progress"]
    launcher = [sys.executable, "-m", "quant"] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m", "quant"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           **timing_env(prefix)}
    t0 = time.perf_counter()
    proc = subprocess.run(launcher + cmd, capture_output=True, text=True, env=env, cwd=REPO)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{ranks} rank(s) failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    records = [json.loads(Path(f"{prefix}.{r}").read_text()) for r in range(ranks)]
    per_rank = {p: [rec["wall_s"][f"gptq_{p}_s"] for rec in records] for p in PHASES}
    cpu_rank = {p: [rec["cpu_s"].get(f"gptq_{p}_s", 0.0) for rec in records] for p in PHASES}
    return {"wall": wall, "phase": {p: max(v) for p, v in per_rank.items()},
            "cpu": {p: max(v) for p, v in cpu_rank.items()}, "per_rank": per_rank, "cpu_rank": cpu_rank,
            "sent": sum(rec["sent"] for rec in records), "log": proc.stderr}


def least(tries: list[dict]) -> dict:
    """The repetitions of one rank count: per phase (and the wall time) the least seen, the noise of a shared
    machine being all on one side."""
    best = dict(tries[0])
    best["wall"] = min(t["wall"] for t in tries)
    for kind in ("phase", "cpu"):
        best[kind] = {p: min(t[kind][p] for t in tries) for p in PHASES}
    return best


def same_bytes(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.glob("*.safetensors")) + ["config.json"]
    return bool(names) and all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


def amdahl_serial(speedup: float, ranks: int) -> float:
    """The serial fraction s of t(N) = t(1) (s + (1 - s) / N) that gives `speedup` on `ranks`, in [0, 1]."""
    if ranks <= 1 or speedup <= 0:
        return 1.0
    return min(1.0, max(0.0, (1 / speedup - 1 / ranks) / (1 - 1 / ranks)))


def extrapolate(one: dict, runs: dict, dims: dict, args) -> None:
    """GLM-5.2 on `args.gpus` ranks, from this machine's CPU seconds (one intra-op thread a process: a phase's CPU
    seconds are its work, where its wall time on a machine shared with other jobs is mostly theirs).

    One device, per layer (as bench_gptq_peers' extrapolation): the layer forward F scales with tokens x FLOPs per
    token (attention + top-k + shared experts); the Hessian accumulation A with (token, expert) pairs x K^2 (the
    one-process Hessian phase less its forward); the solves S with the experts x (R K (R + K) + K^3); one process
    runs the forward once per Hessian pass (11 at the default 4 GiB budget, 160 MiB per expert) and once more to
    feed the next layer.
    N ranks, per layer: two forwards over a 1/N share, F (s + (1 - s) / N) each, s the forward's serial fraction
    fitted from the run at the largest rank count within this machine's cores (more ranks than cores measure the
    oversubscription, not the method); A + S divided among the ranks as the run divides them, by
    `Ranks.assign` over GLM-5.2's own units (one per expert and projection, `schedule.unit_cost` with even routing),
    the slowest rank's share (at this benchmark's scale the units are too coarse to say it: seven a layer); the
    communication the code does for GLM-5.2 (the routed experts' inputs, bf16 hidden states and top-k indices,
    from each batch's rank to every other rank owning experts, once per sweep of the owned Hessians within the
    budget; the shared expert's three inputs to their owners; the solved codes and scales, 4.25 bits a weight,
    gathered to every rank) at --link-gbs GB/s per rank. Not counted: loading the layer (every rank reads it
    whole), the dense layers 0-2, the first layer's calibration."""
    from quant.gptq.ranks import Ranks

    real = glm52_config()
    cores = os.cpu_count() or 1
    usable = [n for n in runs if 1 < n <= cores] or [n for n in runs if n > 1]
    fit_n = max(usable) if usable else 1
    hidden, inter = dims["hidden_size"], dims["moe_intermediate_size"]
    H, I = real["hidden_size"], real["moe_intermediate_size"]
    qk = real["qk_nope_head_dim"] + real["qk_rope_head_dim"]

    def attn(c: dict) -> float:
        h = c["hidden_size"]
        return (h * c["q_lora_rank"] + c["q_lora_rank"] * c["num_attention_heads"] * qk
                + h * (c["kv_lora_rank"] + real["qk_rope_head_dim"])
                + c["kv_lora_rank"] * c["num_attention_heads"] * (real["qk_nope_head_dim"] + real["v_head_dim"])
                + c["num_attention_heads"] * real["v_head_dim"] * h
                + c["q_lora_rank"] * c["index_n_heads"] * real["index_head_dim"]
                + h * real["index_head_dim"] + h * c["index_n_heads"])

    def solve_cost(r: int, k: int) -> float:
        return r * k * (r + k) + k ** 3

    shared, routed = real["n_shared_experts"], real["n_routed_experts"]
    toy_tokens, tokens = args.samples * args.seq_len, 128 * 2048
    toy_k, real_k = dims["num_experts_per_tok"], real["num_experts_per_tok"]
    flops = (tokens * (attn(real) + (real_k + shared) * 3 * H * I)) / (
        toy_tokens * (attn(dims) + (toy_k + shared) * 3 * hidden * inter))
    pairs = (tokens * (real_k + shared) * (H * H + I * I)) / (
        toy_tokens * (toy_k + shared) * (hidden ** 2 + inter ** 2))
    solves = ((routed + shared) * (solve_cost(2 * I, H) + solve_cost(H, I))) / (
        (dims["n_routed_experts"] + shared) * (solve_cost(2 * inter, hidden) + solve_cost(hidden, inter)))
    t1 = one["cpu"]
    forward = t1["forward"] * flops
    accumulate = max(t1["hessians"] - t1["forward"], 0.0) * pairs
    solve = t1["solve"] * solves
    weights = ((routed + shared) * 3 * H * I) / ((dims["n_routed_experts"] + shared) * 3 * hidden * inter)
    apply = t1["apply"] * weights  # every rank dequantizes the whole layer's solved weights into it
    budget, per_expert = 4 << 30, (H * H + I * I) * 4
    passes = -(-routed // max(1, budget // per_expert))
    n = args.gpus
    serial = amdahl_serial(t1["forward"] / max(runs[fit_n]["cpu"]["forward"], 1e-9), fit_n) if fit_n > 1 else 1.0
    # GLM-5.2's units as the run costs them (schedule.unit_cost, even routing): per routed expert its gate_up and its
    # down, and the shared expert's three linears; their owners by the run's own assignment.
    n_e = tokens * real_k / routed
    units = [n_e * H * H + solve_cost(2 * I, H)] * routed + [n_e * (I * I + 2 * I * H) + solve_cost(H, I)] * routed
    units += [tokens * H * H + solve_cost(I, H)] * 2 + [tokens * I * I + solve_cost(H, I)]
    owners = Ranks(0, n).assign(units)
    loads = [sum(c for c, o in zip(units, owners) if o == r) for r in range(n)]
    share = max(loads) / sum(units)  # the slowest rank's share of A + S
    sweeps = -(-max(loads) / sum(units) * routed * per_expert // budget)
    comm = (int(sweeps) * (n - 1) * tokens * (H * 2 + real_k * 8)  # routed inputs to every other owner
            + (n - 1) / n * tokens * (H + H + I) * 2  # the shared expert's gate/up/down inputs to their owners
            + (n - 1) * (routed + shared) * 3 * H * I * 4.25 / 8)  # the solved codes, gathered to every rank
    comm_s = comm / n / (args.link_gbs * 1e9)
    one_layer = (passes + 1) * forward + accumulate + solve + apply
    n_layer = 2 * forward * (serial + (1 - serial) / n) + (accumulate + solve) * share + apply + comm_s
    moe_layers = real["num_hidden_layers"] - real["first_k_dense_replace"] + real["num_nextn_predict_layers"]
    print(f"\nextrapolation to GLM-5.2 on {n} ranks ({moe_layers} MoE layers incl. MTP, {routed} routed + {shared} "
          f"shared experts of [{I}, {H}], top-{real_k}; 128 x 2048 calibration tokens; experts-only), from this "
          f"CPU's CPU seconds:")
    print(f"  per layer, one process: {passes + 1} forwards ({passes} Hessian passes at the 4 GiB budget + 1) of "
          f"{forward:,.0f} s, Hessian accumulation {accumulate:,.0f} s, solves {solve:,.0f} s, applying the solved "
          f"weights {apply:,.0f} s: {one_layer:,.0f} s")
    measured = t1["forward"] / max(runs[fit_n]["cpu"]["forward"], 1e-9) if fit_n > 1 else 1.0
    print(f"  forward's serial fraction {serial:.2f} (from its {measured:.2f}x on {fit_n} ranks)" if fit_n > 1
          else "  no multi-rank run to fit the forward's scaling: taken serial")
    print(f"  per layer, {n} ranks: 2 forwards of a 1/{n} share {2 * forward * (serial + (1 - serial) / n):,.0f} s; "
          f"accumulation + solves {(accumulate + solve) * share:,.0f} s (the slowest rank's share {share:.3f} of "
          f"{len(units)} units, ideal {1 / n:.3f}); applying the solved weights {apply:,.0f} s (every rank, the "
          f"whole layer); communication {comm / 1e9:.0f} GB, {comm_s:,.0f} s at "
          f"{args.link_gbs:g} GB/s per rank ({int(sweeps)} sweep(s) of the owned Hessians): {n_layer:,.0f} s")
    print(f"  whole model, this CPU: {moe_layers * one_layer / 3600:,.0f} h on one process, "
          f"{moe_layers * n_layer / 3600:,.0f} h on {n} ranks ({one_layer / n_layer:.1f}x)")
    if args.gpu_speedup:
        gpu = moe_layers * ((n_layer - comm_s) / args.gpu_speedup + comm_s)  # apply included: a GPU does it too
        print(f"  {n} GPUs at an assumed {args.gpu_speedup:g}x this CPU for forward, Hessians and solves "
              f"(communication as above): {gpu / 3600:.1f} h")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-gptq-ranks"))
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--scale", type=int, default=8, help="GLM-5.2's widths divided by this")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=1, help="runs per rank count; each phase's least time is kept")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads of every process")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--gpu-speedup", type=float, default=None, help="a GPU's speed over this CPU (not measured)")
    ap.add_argument("--link-gbs", type=float, default=10.0, help="GB/s each rank sends at, for the extrapolation")
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.ranks.split(",")]
    if counts[0] != 1:
        sys.exit("--ranks must start with 1 (the one-process run every speed-up is measured against)")
    args.work.mkdir(parents=True, exist_ok=True)
    src, dims = layer_toy(args.work, args.scale, args.experts)
    print(f"one GLM-5-shaped MoE layer: hidden {dims['hidden_size']}, {dims['n_routed_experts']} routed experts of "
          f"[{dims['moe_intermediate_size']}, {dims['hidden_size']}] + {dims['n_shared_experts']} shared, top-"
          f"{dims['num_experts_per_tok']}, {dims['num_attention_heads']} heads; experts-only, {args.samples} x "
          f"{args.seq_len} tokens; {os.cpu_count()} cores, {args.threads} thread(s) a process", flush=True)
    runs = {}
    for n in counts:
        runs[n] = least([run(src, args.work / f"out-{n}", n, args) for _ in range(args.repeat)])
        r, one = runs[n], runs[1]
        same = "" if n == 1 else \
            f"; export byte-identical to 1 process: {same_bytes(args.work / 'out-1', args.work / f'out-{n}')}"

        def ratio(kind: str, p: str, n: int = n, r: dict = r, one: dict = one) -> str:
            return f" ({one[kind][p] / r[kind][p]:.2f}x)" if n > 1 and p != "comm" and r[kind][p] > 0 else ""

        print(f"{n} rank(s): wall {r['wall']:.1f} s ({one['wall'] / r['wall']:.2f}x), sent {r['sent'] / 1e6:.1f} MB"
              f"{same}", flush=True)
        for kind, label in (("phase", "seconds"), ("cpu", "CPU seconds")):
            print(f"  {label} (slowest rank): " + ", ".join(f"{p} {r[kind][p]:.2f}{ratio(kind, p)}" for p in PHASES),
                  flush=True)
        if n > 1:
            print("  per rank, seconds: " + ", ".join(f"{p} " + "/".join(f"{x:.2f}" for x in r["per_rank"][p])
                                                     for p in PHASES), flush=True)
    extrapolate(runs[1], runs, dims, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
