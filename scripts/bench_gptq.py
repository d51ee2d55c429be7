"""Benchmark: GPTQ vs round-to-nearest MXFP4 on a quantization-sensitive toy, and GPTQ's memory as layers are added.

1. Accuracy. The toy is the arithmetic model of the eval stage (scripts/train_toy_arith.py: GLM-5 layout, MLA
   attention with the DSA indexer, a dense and a MoE layer), trained here without its MXFP4 fake-quant phase and
   without weight decay (`--qat-from 1.0 --weight-decay 0`), and on GSM8K's training text beside the task
   (`--text`). The committed fixture (evals/data/toy_arith/model) is neither: fake-quant made it robust to 4-bit
   rounding and its task alone is saturated (answer NLL about 0.007 nats/token, RTN changes it by noise), so
   RTN does not measurably lose on it. Exports, all-linear recipe (every linear in MXFP4: attention, dense
   MLP, shared and routed experts): `quant quantize --method rtn`, `--method gptq` (calibrated on GSM8K's
   training text), and the block-FP8 baseline. Reported: held-out NLL (nats per token) on GSM8K test text and
   on the arithmetic answers, for BF16, FP8, RTN and GPTQ, with the fraction of RTN's loss GPTQ recovers; then
   `quant eval` (toy_arith, greedy 5-shot) of GPTQ, RTN and BF16 each against the FP8 baseline.
2. Memory. GLM-5-shaped toys of growing depth (same layer, 2 to 8 decoder layers) quantized with `--method gptq`
   as whole processes: peak RSS against the size of one layer (fp32, as the CPU path computes) plus the
   calibration activations. Streaming layer by layer means peak RSS stays flat as layers are added.

    .venv/bin/python scripts/bench_gptq.py --gsm8k-dir DIR [--work DIR] [--samples 128] [--seq-len 256]

--gsm8k-dir holds GSM8K's train.jsonl and test.jsonl (question/answer records); without it they are fetched
with `datasets` (openai/gsm8k). Training the toy takes about 4 minutes on 2 cores (cached in --work).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ARITH = REPO / "evals" / "data" / "toy_arith"


def sh(cmd: list[str], **kw) -> float:
    """Run a command; returns its peak RSS in bytes (the child's own, via wait4)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"command failed: {' '.join(cmd)}\n{out[-3000:]}")
    return usage.ru_maxrss * 1024


def quant(*args: str) -> float:
    return sh([sys.executable, "-m", "quant.cli", "quantize", *args, "--no-progress", "--check-engines", ""])


def gsm8k(work: Path, directory: Path | None) -> Path:
    if directory:
        return directory
    target = work / "gsm8k"
    if not (target / "test.jsonl").is_file():
        import datasets

        target.mkdir(parents=True, exist_ok=True)
        for split in ("train", "test"):
            rows = datasets.load_dataset("openai/gsm8k", "main", split=split)
            (target / f"{split}.jsonl").write_text("".join(json.dumps({"question": r["question"],
                                                                       "answer": r["answer"]}) + "\n" for r in rows))
    return target


def sensitive_toy(work: Path, text: Path) -> Path:
    model = work / "toy-text-no-qat" / "model"
    if not (model / "config.json").is_file():
        print("training the toy without fake-quant or weight decay, with GSM8K text (scripts/train_toy_arith.py "
              "--qat-from 1.0 --weight-decay 0 --text ... --steps 600) ...", flush=True)
        t = time.perf_counter()
        sh([sys.executable, str(REPO / "scripts" / "train_toy_arith.py"), "--qat-from", "1.0", "--weight-decay", "0",
            "--text", str(text), "--steps", "600", "--mtp-steps", "1", "--eval-limit", "8", "--out", str(model),
            "--data-dir", str(model.parent)])
        print(f"  trained in {time.perf_counter() - t:.0f} s", flush=True)
    return model


def accuracy(work: Path, args) -> None:
    from evals.arms.nll import mean_nll

    data = gsm8k(work, args.gsm8k_dir)
    src = sensitive_toy(work, data / "train.jsonl")
    calib = ["--calib-data", str(data / "train.jsonl"), "--calib-samples", str(args.samples),
             "--calib-seq-len", str(args.seq_len)]
    exports = {"RTN": work / "rtn", "GPTQ": work / "gptq", "FP8": work / "fp8"}
    t = time.perf_counter()
    quant(str(src), str(exports["RTN"]), "--recipe", "all-linear")
    t_rtn = time.perf_counter() - t
    t = time.perf_counter()
    quant(str(src), str(exports["GPTQ"]), "--recipe", "all-linear", "--method", "gptq", *calib)
    t_gptq = time.perf_counter() - t
    quant(str(src), str(exports["FP8"]), "--recipe", "all-linear", "--scheme", "fp8-block")
    print(f"exports: RTN {t_rtn:.1f} s, GPTQ {t_gptq:.1f} s ({args.samples} windows x {args.seq_len} tokens of "
          f"GSM8K train), all-linear recipe")

    rows = [json.loads(line) for line in (data / "test.jsonl").read_text().splitlines()][:args.limit]
    joined = "\n\n".join(f"{r['question']}\n{r['answer']}" for r in rows)
    text = [joined[i:i + 256] for i in range(0, len(joined) - 255, 256)]  # byte tokens: 256-token windows
    arith = [json.loads(line) for line in (ARITH / "test.jsonl").read_text().splitlines()][:args.limit]
    answers = [(f"Question: {r['question']}\nAnswer:", " " + r["answer"]) for r in arith]
    models = {"BF16": src, **{k: exports[k] for k in ("FP8", "RTN", "GPTQ")}}
    for label, texts in ((f"GSM8K test text ({len(rows)} rows, {len(text)} windows of 256 tokens)", text),
                         (f"toy_arith answers ({len(answers)} held-out questions)", answers)):
        nll = {k: mean_nll(path, texts) for k, path in models.items()}
        lost = nll["RTN"] - nll["BF16"]
        recovered = (nll["RTN"] - nll["GPTQ"]) / lost if lost > 0 else float("nan")
        print(f"held-out NLL, {label}, nats/token: " + ", ".join(f"{k} {v:.4f}" for k, v in nll.items()))
        print(f"  vs BF16: RTN {lost:+.4f}, GPTQ {nll['GPTQ'] - nll['BF16']:+.4f}, FP8 {nll['FP8'] - nll['BF16']:+.4f}"
              f"; GPTQ recovers {recovered:.0%} of RTN's loss", flush=True)

    from evals.compare import EvalRequest, evaluate

    base_run = None
    for name, candidate in (("GPTQ", exports["GPTQ"]), ("RTN", exports["RTN"]), ("BF16", src)):
        out = work / f"eval-{name.lower()}-vs-fp8"
        request = EvalRequest(candidate=str(candidate), baseline=None if base_run else str(exports["FP8"]),
                              baseline_run=base_run, tasks="toy_arith", limit=args.limit, max_gen_toks=24,
                              batch_size=40, out=out, mtp=False, baseline_name="FP8", candidate_name=name)
        report = evaluate(request, log=lambda m: None).to_json()
        base_run = base_run or out
        row = next(r for r in report["rows"] if r["primary"])["comparison"]
        print(f"quant eval {name} vs FP8 (toy_arith, {row['n_questions']} questions): FP8 "
              f"{row['baseline_accuracy']:.3f}, {name} {row['candidate_accuracy']:.3f}, difference "
              f"{100 * row['difference']:+.1f} pt [{100 * row['ci_low']:+.1f}, {100 * row['ci_high']:+.1f}], "
              f"McNemar p {row['mcnemar_p']:.3g}, verdict {report['verdict']} ({out / 'report.md'})", flush=True)


def memory(work: Path, args) -> None:
    from quant.toy import build_toy

    dims = {"hidden_size": 1024, "moe_intermediate_size": 512, "intermediate_size": 2048, "n_routed_experts": 16,
            "num_experts_per_tok": 4, "first_k_dense_replace": 1, "q_lora_rank": 256, "kv_lora_rank": 128,
            "num_nextn_predict_layers": 0}
    samples, seq_len = 32, 256
    calib = work / "calib.txt"
    calib.write_text("\n\n".join(json.loads(line)["question"] + " " + json.loads(line)["answer"]
                                 for line in (ARITH / "train.jsonl").read_text().splitlines()) * 4)
    print(f"\nmemory: GLM-5 toy layers ({dims['hidden_size']} hidden, {dims['n_routed_experts']} experts of "
          f"{dims['moe_intermediate_size']}), `--method gptq --recipe all-linear`, {samples} windows x {seq_len}")
    for layers in (2, 4, 8):
        src = work / f"mem-{layers}"
        if not (src / "config.json").is_file():
            build_toy("glm5", src, overrides={**dims, "num_hidden_layers": layers}, force=True)
        size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        out = work / f"mem-{layers}-gptq"
        t = time.perf_counter()
        rss = quant(str(src), str(out), "--recipe", "all-linear", "--method", "gptq", "--calib-data", str(calib),
                    "--calib-samples", str(samples), "--calib-seq-len", str(seq_len))
        took = time.perf_counter() - t
        rss_rtn = quant(str(src), str(work / f"mem-{layers}-rtn"), "--recipe", "all-linear")
        layer_fp32 = 2 * size / layers  # bf16 source -> fp32, the largest (MoE) layer is about the mean here
        acts = 2 * samples * seq_len * dims["hidden_size"] * 4
        print(f"  {layers} layers, source {size / 1e6:.0f} MB: peak RSS GPTQ {rss / 1e6:.0f} MB, RTN "
              f"{rss_rtn / 1e6:.0f} MB; one layer in fp32 ~{layer_fp32 / 1e6:.0f} MB + activations (in and out) "
              f"{acts / 1e6:.0f} MB; {took:.1f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-gptq"))
    ap.add_argument("--gsm8k-dir", type=Path, help="directory with GSM8K's train.jsonl and test.jsonl")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--limit", type=int, default=200, help="held-out questions for NLL and quant eval")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-accuracy", action="store_true")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    for d in args.work.glob("*"):
        if d.name in ("rtn", "gptq", "fp8") or d.name.startswith(("eval-", "mem-")) and d.name.endswith(
                ("-gptq", "-rtn", "-vs-fp8")):
            subprocess.run(["rm", "-rf", str(d)], check=True)
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores")
    if not args.skip_accuracy:
        accuracy(args.work, args)
    if not args.skip_memory:
        memory(args.work, args)
    print(f"(this process: peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3:.0f} MB)")


if __name__ == "__main__":
    main()
