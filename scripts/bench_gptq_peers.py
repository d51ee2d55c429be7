"""Benchmark: GPTQ against its peers on the sensitive toy, and GPTQ's phases on a GLM-5-shaped layer (issue #24).

1. Peers. tests/data/gptq_toy (the toy tests/test_gptq.py scores), every linear in MXFP4 weight-only (recipe
   all-linear), for each calibration seed (the seed that draws the 64 windows of 128 tokens from its calib.jsonl):
     - this tool's round to nearest and `--method gptq` (in process, quantize_checkpoint);
     - llm-compressor 0.14.0.1's GPTQModifier, scheme MXFP4A16, its defaults otherwise, in a venv of its own
       (.venv-llmc, built here on first use), fed the very same token windows (tokenized by this tool's
       calibration code) and the same modules (ignore: lm_head, the routers, the indexer's wk and weights_proj,
       which all-linear keeps BF16). Its compressed-tensors output is decompressed with compressed-tensors' own
       MXFP4 decompressor into a BF16 checkpoint with the source's tensor names (MXFP4 values times E8M0 scales
       are exact in BF16; the MTP layer, which transformers never runs, stays the source's);
     - with --with-autoround, auto-round 0.16.1 (scheme MXFP4, 200 iterations) in .venv-autoround the same way
       (run once: auto-round 0.16.1 then fails in its quantize_layer_outside_block on this toy, BENCHMARKS.md;
       a failure skips the row).
   Every checkpoint is scored by the same code (`evals.arms.nll.mean_nll` on `gptq_toy_heldout()`, both from the
   suite); reported: held-out NLL, the share of RTN's NLL loss recovered, (NLL_rtn - NLL) / (NLL_rtn - NLL_bf16),
   and wall time. A venv that cannot be built or a peer that fails prints one line and its row is left out.
2. Phases. A one-layer GLM-5-shaped MoE checkpoint (GLM-5.2's attention, hidden size and expert shapes from
   tests/data/glm52_config; --experts routed experts instead of 256, top-k min(8, experts), one shared expert),
   `--method gptq` with the default experts-only recipe on devices ["cpu"] and ["cpu", "cpu"]: seconds per phase
   (the manifest's timing, quant.gptq.run.PHASES; write = the shard pass), the two exports compared byte for
   byte, then an extrapolation to GLM-5.2 on --gpus workers from the measured per-expert costs (see `extrapolate`).

    .venv/bin/python scripts/bench_gptq_peers.py [--seeds 0,1,2] [--experts 4] [--no-llmc] [--with-autoround]
        [--skip-peers] [--skip-phases] [--gpus 8] [--gpu-speedup F] [--work /tmp/bench-gptq-peers]
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

from peer_venvs import build_peer_venv  # scripts/: this script's own folder

REPO = Path(__file__).resolve().parent.parent
PEERS = {
    # name: (venv, packages, label)
    "llmc": (REPO / ".venv-llmc", ["llmcompressor==0.14.0.1"], "llm-compressor 0.14.0.1 GPTQ (MXFP4A16, defaults)"),
    "autoround": (REPO / ".venv-autoround", ["auto-round==0.16.1", "compressed-tensors"],
                  "auto-round 0.16.1 (MXFP4, 200 iters)"),
}
# What all-linear keeps BF16 among the toy's nn.Linear modules (the routers are not nn.Linear in transformers).
KEEP = ["lm_head", "re:.*indexer\\.wk$", "re:.*indexer\\.weights_proj$", "re:.*mlp\\.gate$"]


# ---------------------------------------------------------------------------------------------------- peer venvs

def peer_venv(name: str) -> Path | None:
    """The python of the peer's venv, built on first use (scripts/peer_venvs.py; transformers set to this venv's
    release, which the toy's glm_moe_dsa config needs: llm-compressor 0.14 pins transformers <= 5.17, whose config
    validation refuses the toy's `indexed_attention` layer types). None, with one line, if it cannot be built."""
    venv, packages, label = PEERS[name]
    return build_peer_venv(venv, packages, label)


def run_peer(name: str, python: Path, src: Path, windows: Path, out: Path) -> dict | None:
    """Quantize `src` with peer `name` in its venv (this script, --peer-worker); returns its record (seconds) or
    None with one line saying why."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    proc = subprocess.run([str(python), __file__, "--peer-worker", name, str(src), str(windows), str(out)],
                          capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    (out / "worker.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not (out / "record.json").is_file():
        last = [line for line in (proc.stderr or proc.stdout).strip().splitlines() if line.strip()][-1:] or ["?"]
        print(f"{PEERS[name][2]}: failed, row skipped ({last[0][:240]}; see {out / 'worker.log'})")
        return None
    record = json.loads((out / "record.json").read_text())
    record["process_s"] = time.perf_counter() - t0
    return record


def peer_worker(name: str, src: Path, windows: Path, out: Path) -> None:  # noqa: PLR0915 (one peer run, read top to bottom)
    """Runs in the peer's venv: quantize `src` on the token windows `windows` (JSON list of id lists), then write
    `out/bf16`, a BF16 checkpoint of its quantized weights under the source's names, and `out/record.json`."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = json.loads(windows.read_text())
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    tokenizer = AutoTokenizer.from_pretrained(src)
    if name == "llmc":
        from datasets import Dataset
        from llmcompressor import oneshot
        from llmcompressor.modifiers.gptq import GPTQModifier

        data = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(r) for r in ids]})
        oneshot(model=model, dataset=data, recipe=GPTQModifier(targets="Linear", scheme="MXFP4A16", ignore=KEEP),
                tokenizer=tokenizer, max_seq_length=len(ids[0]), num_calibration_samples=len(ids))
        quantized = out / "compressed"
        model.save_pretrained(quantized, save_compressed=True)
    else:  # auto-round
        from auto_round import AutoRound

        layer_config = {n: {"bits": 16} for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                        and (n == "lm_head" or n.endswith(("indexer.wk", "indexer.weights_proj", "mlp.gate")))}
        rounder = AutoRound(model, tokenizer, scheme="MXFP4", iters=200, dataset=[torch.tensor([r]) for r in ids],
                            nsamples=len(ids), seqlen=len(ids[0]), layer_config=layer_config)
        quantized = out / "compressed"
        rounder.quantize_and_save(str(quantized), format="llm_compressor")
    seconds = time.perf_counter() - t0

    # Decompress with compressed-tensors' own MXFP4 decompressor, into the source's names and dtypes.
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    config = json.loads((quantized / "config.json").read_text())["quantization_config"]
    groups = list(config["config_groups"].values())
    if len(groups) != 1 or groups[0].get("format", config.get("format")) != "mxfp4-pack-quantized":
        raise SystemExit(f"unexpected quantization_config: {json.dumps(config)[:400]}")
    scheme = QuantizationScheme(targets=groups[0]["targets"], weights=QuantizationArgs(**groups[0]["weights"]))
    packed = {}
    for file in sorted(quantized.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            packed.update({k: f.get_tensor(k) for k in f.keys()})
    bf16 = out / "bf16"
    bf16.mkdir()
    tensors, replaced = {}, 0
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                stem = key.removesuffix(".weight")
                if key.endswith(".weight") and f"{stem}.weight_packed" in packed:
                    state = {s: packed[f"{stem}.{s}"] for s in ("weight_packed", "weight_scale")}
                    weight = MXFP4PackedCompressor.decompress(state, scheme)["weight"].to(torch.float32)
                    exact = weight.to(tensor.dtype)
                    if not torch.equal(exact.to(torch.float32), weight) or weight.shape != tensor.shape:
                        raise SystemExit(f"{key}: decompressed weight not exact in {tensor.dtype} or misshaped")
                    tensor, replaced = exact, replaced + 1
                tensors[key] = tensor.contiguous()
    save_file(tensors, str(bf16 / "model.safetensors"), metadata={"format": "pt"})
    for extra in src.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and not extra.name.endswith(".index.json"):
            shutil.copy2(extra, bf16 / extra.name)
    (out / "record.json").write_text(json.dumps({"seconds": seconds, "quantized_weights": replaced}))


# --------------------------------------------------------------------------------------------------------- peers

def peers(args) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    from test_gptq import GPTQ_TOY, gptq_toy_calibration, gptq_toy_heldout  # noqa: E402 (the suite's own)

    from evals.arms.nll import mean_nll
    from quant.gptq import GptqSettings
    from quant.gptq.calibration import calibration_tokens
    from quant.pipeline import quantize_checkpoint

    src, work = GPTQ_TOY / "model", args.work / "peers"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    texts = gptq_toy_heldout()
    pythons = {}
    for name in (["llmc"] if args.llmc else []) + (["autoround"] if args.with_autoround else []):
        pythons[name] = peer_venv(name)
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"\npeers: {src.relative_to(REPO)}, recipe all-linear (MXFP4 weights), {len(texts)} held-out windows "
          f"of 128 tokens, calibration 64 x 128 tokens of calib.jsonl, seeds {seeds}", flush=True)

    def ours(method: str, seed: int) -> tuple[Path, float]:
        out = work / f"{method}-{seed}"
        t0 = time.perf_counter()
        quantize_checkpoint(src, out, recipe="all-linear", method=method,
                            gptq=GptqSettings(gptq_toy_calibration(seed)), check_engines=None, log=lambda m: None)
        return out, time.perf_counter() - t0

    nll = {"bf16": mean_nll(src, texts)}
    rtn, rtn_s = ours("rtn", 0)  # no calibration: one export serves every seed
    nll["rtn"] = mean_nll(rtn, texts)
    lost = nll["rtn"] - nll["bf16"]
    print(f"BF16 {nll['bf16']:.4f}, RTN {nll['rtn']:.4f} (+{lost:.4f}) nats/token; RTN export {rtn_s:.1f} s",
          flush=True)
    rows: dict[str, dict[int, tuple[float, float]]] = {}
    for seed in seeds:
        path, seconds = ours("gptq", seed)
        rows.setdefault("ours", {})[seed] = (mean_nll(path, texts), seconds)
        windows = work / f"windows-{seed}.json"
        windows.write_text(json.dumps(calibration_tokens(gptq_toy_calibration(seed), src).tolist()))
        for name, python in pythons.items():
            if python is None:
                continue
            record = run_peer(name, python, src, windows, work / f"{name}-{seed}")
            if record is not None:
                rows.setdefault(name, {})[seed] = (mean_nll(work / f"{name}-{seed}" / "bf16", texts),
                                                   record["seconds"])
        for name, by_seed in rows.items():
            if seed in by_seed:
                value, seconds = by_seed[seed]
                print(f"  seed {seed}: {name}: NLL {value:.4f}, recovers {(nll['rtn'] - value) / lost:.0%}, "
                      f"{seconds:.1f} s", flush=True)

    labels = {"ours": "moe-quant `--method gptq`", **{k: v[2] for k, v in PEERS.items()}}
    print(f"\n| tool, method | {' | '.join(f'seed {s}' for s in seeds)} | mean of {len(seeds)} seeds | "
          f"NLL (mean) | wall s (mean) |")
    print("|---" * (len(seeds) + 4) + "|")
    print(f"| round to nearest | {' | '.join('0%' for _ in seeds)} | 0% | {nll['rtn']:.4f} | {rtn_s:.1f} |")
    for name, by_seed in rows.items():
        shares = [(nll["rtn"] - by_seed[s][0]) / lost if s in by_seed else None for s in seeds]
        have = [x for x in shares if x is not None]
        mean_nll_ = sum(by_seed[s][0] for s in by_seed) / len(by_seed)
        mean_s = sum(by_seed[s][1] for s in by_seed) / len(by_seed)
        print(f"| {labels[name]} | {' | '.join(f'{x:.0%}' if x is not None else '-' for x in shares)} | "
              f"{sum(have) / len(have):.0%} | {mean_nll_:.4f} | {mean_s:.1f} |")
    print(f"(BF16 NLL {nll['bf16']:.4f}; recovered = (NLL_rtn - NLL) / (NLL_rtn - NLL_bf16); ours timed in process, "
          f"peers from model load to saved output, without their Python imports)", flush=True)


# -------------------------------------------------------------------------------------------------------- phases

def glm52_config() -> dict:
    return json.loads((REPO / "tests" / "data" / "glm52_config" / "config.json").read_text())


def layer_toy(work: Path, experts: int, scale: int = 1) -> tuple[Path, dict]:
    """A one-layer GLM-5-shaped MoE checkpoint: GLM-5.2's attention, hidden and expert sizes, `experts` routed;
    with `scale` > 1 the widths (hidden, expert, LoRA ranks) and head counts divided by it
    (scripts/bench_gptq_ranks.py)."""
    from quant.toy import build_toy

    real = glm52_config()
    keys = ("hidden_size", "moe_intermediate_size", "n_shared_experts", "q_lora_rank", "kv_lora_rank",
            "num_attention_heads", "num_key_value_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "index_n_heads", "index_head_dim", "head_dim")
    overrides = {k: real[k] for k in keys if k in real}
    for k in ("hidden_size", "moe_intermediate_size", "q_lora_rank", "kv_lora_rank"):
        overrides[k] = max(32, overrides[k] // scale)
    for k in ("num_attention_heads", "num_key_value_heads", "index_n_heads"):
        overrides[k] = max(1, overrides[k] // scale)
    overrides.update(num_hidden_layers=1, first_k_dense_replace=0, n_routed_experts=experts,
                     num_experts_per_tok=min(real["num_experts_per_tok"], experts), num_nextn_predict_layers=0)
    src = work / (f"glm5-layer-{experts}" + (f"-s{scale}" if scale > 1 else ""))
    if not (src / "config.json").is_file():
        build_toy("glm5", src, overrides=overrides, force=True)
    return src, overrides


def phases(args) -> None:
    from quant.gptq import CalibrationSettings, GptqSettings
    from quant.gptq.run import PHASES
    from quant.pipeline import quantize_checkpoint

    work = args.work / "phases"
    work.mkdir(parents=True, exist_ok=True)
    src, dims = layer_toy(work, args.experts)
    calib = CalibrationSettings(str(REPO / "tests" / "data" / "gptq_toy" / "calib.jsonl"),
                                samples=args.phase_samples, seq_len=args.phase_seq_len)
    print(f"\nphases: one GLM-5-shaped MoE layer (hidden {dims['hidden_size']}, {args.experts} routed experts of "
          f"{dims['moe_intermediate_size']} + {dims['n_shared_experts']} shared, top-{dims['num_experts_per_tok']}, "
          f"GLM-5.2's attention), `--method gptq`, recipe experts-only, {calib.samples} x {calib.seq_len} tokens",
          flush=True)
    runs = {}
    for devices in (["cpu"], ["cpu", "cpu"]):
        out = work / f"out-{len(devices)}"
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        manifest = quantize_checkpoint(src, out, method="gptq", devices=devices, gptq=GptqSettings(calib),
                                       check_engines=None, log=lambda m: None)
        # The manifest's shards_s runs from the start of the run (GPTQ included): the write is what follows GPTQ.
        timing = dict(manifest["timing"], wall_s=time.perf_counter() - t0)
        timing["write_s"] = timing["shards_s"] - timing["gptq_s"]
        runs[len(devices)] = timing
        solved = sum(1 for r in manifest["tensors"].values() if r.get("method", {}).get("method") == "gptq")
        print(f"  {len(devices)} worker(s): {solved} weights solved, " + ", ".join(
            f"{k.removeprefix('gptq_')} {timing[k]:.1f}" for k in PHASES) +
            f", write (shard pass) {timing['write_s']:.1f}, gptq total {timing['gptq_s']:.1f}, wall "
            f"{timing['wall_s']:.1f} s", flush=True)
    same = all((work / "out-1" / p.name).read_bytes() == p.read_bytes()
               for p in sorted((work / "out-2").glob("*.safetensors")))
    print(f"  1 vs 2 workers: shards byte-identical: {same}; solve {runs[1]['gptq_solve_s']:.1f} -> "
          f"{runs[2]['gptq_solve_s']:.1f} s ({runs[2]['gptq_solve_s'] / runs[1]['gptq_solve_s']:.2f}x)")
    extrapolate(runs[1], dims, args.experts, calib, args.gpus, args.gpu_speedup)


def extrapolate(t: dict, dims: dict, experts: int, calib, gpus: int, speedup: float | None) -> None:
    """GLM-5.2 (tests/data/glm52_config) from the one-worker run, phase by phase. Assumptions, printed too:
    solves and Hessian accumulation scale with the number of experts solved (routed + shared, every MoE layer and
    the MTP layer) and the Hessians also with the calibration tokens each expert sees (tokens x top-k / experts);
    the layer forward (in `hessians` and `forward`) with tokens x the matmul FLOPs of a token (attention + top-k
    + shared experts, 2 x active parameters); load and write with the layer's bytes. Solves are shared by `gpus`
    workers (ideal balance; measured here: two CPU workers above), the forward passes and Hessians stay on the
    first device (as quant.gptq.run does). CPU-measured: `speedup` (a GPU's speed over this CPU for these phases)
    is not measured and is left a parameter."""
    real = glm52_config()
    hidden, inter = dims["hidden_size"], dims["moe_intermediate_size"]
    expert_params = 3 * hidden * inter
    heads, qk = real["num_attention_heads"], real["qk_nope_head_dim"] + real["qk_rope_head_dim"]
    attn = (hidden * real["q_lora_rank"] + real["q_lora_rank"] * heads * qk
            + hidden * (real["kv_lora_rank"] + real["qk_rope_head_dim"])
            + real["kv_lora_rank"] * heads * (real["qk_nope_head_dim"] + real["v_head_dim"])
            + heads * real["v_head_dim"] * hidden
            + real["q_lora_rank"] * real["index_n_heads"] * real["index_head_dim"]
            + hidden * real["index_head_dim"] + hidden * real["index_n_heads"])
    shared = real["n_shared_experts"]
    moe_layers = real["num_hidden_layers"] - real["first_k_dense_replace"] + real["num_nextn_predict_layers"]
    toy_experts, real_experts = experts + dims["n_shared_experts"], real["n_routed_experts"] + shared
    toy_tokens = calib.samples * calib.seq_len
    real_tokens = 128 * 2048  # the default calibration, 128 windows x 2048 tokens
    toy_k, real_k = dims["num_experts_per_tok"], real["num_experts_per_tok"]
    flops = (real_tokens * (attn + (real_k + shared) * expert_params)) / (
        toy_tokens * (attn + (toy_k + dims["n_shared_experts"]) * expert_params))
    # Hessian pass = one layer forward (as `forward`) + accumulation; accumulation per expert-token, K^2 each.
    accumulate = max(t["gptq_hessians_s"] - t["gptq_forward_s"], 0.0)
    toy_pairs = toy_tokens * (toy_k + dims["n_shared_experts"])
    real_pairs = real_tokens * (real_k + shared)
    per_layer = {
        "forward (calibration forward, one layer)": t["gptq_forward_s"] * flops,
        "Hessians (accumulation; its forward counted above)": accumulate * real_pairs / toy_pairs,
        "solve (1 worker)": t["gptq_solve_s"] * real_experts / toy_experts,
        "load + write": (t["gptq_load_s"] + t["gptq_save_s"] + t["write_s"])
        * (attn + real_experts * expert_params) / (attn + toy_experts * expert_params),
    }
    # Each Hessian pass runs the layer forward again; the routed experts' Hessians are cut into passes of
    # GptqSettings.hessian_bytes (the shared expert is a plain linear here: it rides along with the first pass).
    from quant.gptq import GptqSettings

    budget = GptqSettings().hessian_bytes
    per_expert = (hidden ** 2 + inter ** 2) * 4
    passes = -(-real["n_routed_experts"] // max(1, budget // per_expert))
    forward_twice = per_layer["forward (calibration forward, one layer)"] * (1 + passes)
    print(f"\nextrapolation to GLM-5.2 ({moe_layers} MoE layers incl. MTP, {real['n_routed_experts']} routed + "
          f"{shared} shared experts of [{inter}, {hidden}], top-{real_k}; calibration 128 x 2048 tokens; "
          f"experts-only), from this CPU's one-worker figures:")
    print(f"  Hessian passes per layer: {passes} (budget {budget / 2**30:.0f} GiB, {per_expert / 2**20:.0f} MiB per "
          f"expert; each pass runs the layer forward again; --hessian-budget raises it)")
    print(f"  per expert: solve {t['gptq_solve_s'] / toy_experts:.1f} s; Hessian accumulation "
          f"{accumulate / toy_pairs * 1e6:.2f} us per token and expert")
    for k, v in per_layer.items():
        print(f"  per layer, {k}: {v:.0f} s")
    serial = forward_twice + per_layer["Hessians (accumulation; its forward counted above)"] + per_layer["load + write"]
    total_1 = moe_layers * (serial + per_layer["solve (1 worker)"])
    total_n = moe_layers * (serial + per_layer["solve (1 worker)"] / gpus)
    factor = speedup or 1.0
    print(f"  whole model, this CPU, 1 worker: {total_1 / 3600:.0f} h; solves shared by {gpus} workers "
          f"(ideal): {total_n / 3600:.0f} h (forward and Hessians on the first device, solves / {gpus})")
    gpu = moe_layers * ((forward_twice + per_layer["Hessians (accumulation; its forward counted above)"]
                         + per_layer["solve (1 worker)"] / gpus) / factor + per_layer["load + write"])
    print(f"  {gpus} GPUs at {'an assumed ' if speedup else 'an unmeasured (set --gpu-speedup) '}{factor:g}x this "
          f"CPU for forward, Hessians and solves (load and write unchanged): {gpu / 3600:.1f} h "
          f"(dense layers 0-{real['first_k_dense_replace'] - 1} and the first layer's calibration not counted)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-gptq-peers"))
    ap.add_argument("--seeds", default="0,1,2", help="calibration window seeds")
    ap.add_argument("--no-llmc", dest="llmc", action="store_false", help="leave llm-compressor out")
    ap.add_argument("--with-autoround", action="store_true",
                    help="add auto-round 0.16.1 (.venv-autoround; fails inside auto-round on this toy, see "
                         "BENCHMARKS.md)")
    ap.add_argument("--skip-peers", action="store_true")
    ap.add_argument("--skip-phases", action="store_true")
    ap.add_argument("--experts", type=int, default=4, help="routed experts of the GLM-5-shaped layer")
    ap.add_argument("--phase-samples", type=int, default=16)
    ap.add_argument("--phase-seq-len", type=int, default=256)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--gpu-speedup", type=float, default=None,
                    help="a GPU's speed over this CPU for forward, Hessians and solves (not measured here)")
    ap.add_argument("--peer-worker", nargs=4, metavar=("NAME", "SRC", "WINDOWS", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.peer_worker:  # inside a peer's venv: nothing of this project is imported
        name, src, windows, out = args.peer_worker
        peer_worker(name, Path(src), Path(windows), Path(out))
        return 0
    sys.path.insert(0, str(REPO))
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    args.work.mkdir(parents=True, exist_ok=True)
    if not args.skip_peers:
        peers(args)
    if not args.skip_phases:
        phases(args)
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
