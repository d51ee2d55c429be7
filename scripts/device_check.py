"""The GPU box's one prepared check (issue #44): `scripts/device_check.sh` runs it on an H200 in one call; with
`--cpu-smoke` the same steps run at toy width on the CPU (tests/test_device_check.py, in `make test`), so it
cannot rot.

Steps, each timed, each recorded in one JSON of raw figures (`--out`, default device-check.json) whether it
passed or failed (a failed step records its error and the next one still runs):

1. `cuda_tests`: tests/test_cuda.py under pytest (the numerics' bytes on CUDA against the CPU's, a round-to-nearest
   export on cuda:0 against the CPU export, the in-process scoring on CUDA); on the CPU they are skipped.
2. `rtn_throughput`: MXFP4 round to nearest of one full-width GLM-5.2 MoE layer's expert weights (256 routed
   experts of [2048, 6144] gate and up and [6144, 2048] down, BF16) on the device, and the same kernels on the
   CPU over the first experts (the CPU's rate extrapolated to the layer), bytes per second of each and the ratio.
3. `gptq_layer`: GPTQ (all-linear, the default calibration's token count: 128 windows of 2048 tokens) of one
   full-width GLM-5.2 decoder layer (tests/data/glm52_config: MLA, the DSA indexer, 256 routed experts of 2048
   plus the shared expert; one MoE layer, no MTP) built as the glm5 toy is built, with synthetic weights: the
   seconds per phase the run reports (calibration, load, Hessians, solves, apply, forward, save), the peak device
   memory observed against the dry run's prediction for the same run, and the export's bytes.
4. `gptq_toy`: the same GPTQ at the sizes the CPU tests use (the glm5 toy, 32 windows of 32 tokens) on the device
   and on the CPU, so the two machines can be compared.

Nothing here is estimated: a figure that was not measured is absent (null), never filled in.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
GLM52 = REPO / "tests" / "data" / "glm52_config" / "config.json"
CALIB_TEXT = REPO / "evals" / "data" / "toy_arith" / "train.jsonl"

# The keys of tests/data/glm52_config the full-width layer takes; one MoE layer, no MTP layer.
GLM52_KEYS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "n_routed_experts", "n_shared_experts",
              "num_experts_per_tok", "num_attention_heads", "num_key_value_heads", "head_dim", "q_lora_rank",
              "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_topk", "index_head_dim",
              "index_n_heads", "routed_scaling_factor", "n_group", "topk_group")
ONE_MOE_LAYER = {"num_hidden_layers": 1, "first_k_dense_replace": 0, "num_nextn_predict_layers": 0,
                 "max_position_embeddings": 4096}
# --cpu-smoke: the same layer at the glm5 toy's width (its own config, one MoE layer).
SMOKE_LAYER = {"num_hidden_layers": 1, "first_k_dense_replace": 0, "num_nextn_predict_layers": 0}


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _timed(device: str, fn):
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


# -- 1 ------------------------------------------------------------------------------------------------------------
def cuda_tests(smoke: bool) -> dict:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py",
                           "-rA"], cwd=REPO, capture_output=True, text=True, timeout=600)
    tail = proc.stdout.strip().splitlines()[-1:] or [""]
    if proc.returncode != 0:
        raise RuntimeError(f"tests/test_cuda.py: pytest exit {proc.returncode}: {tail[0]} "
                           f"{(proc.stdout + proc.stderr)[-1500:]}")
    return {"exit_code": proc.returncode, "summary": tail[0],
            "failed": [line for line in proc.stdout.splitlines() if line.startswith("FAILED")]}


# -- 2 ------------------------------------------------------------------------------------------------------------
def rtn_throughput(device: str, smoke: bool) -> dict:
    import torch

    from quant.numerics import mxfp4

    cfg = json.loads(GLM52.read_text())
    experts, hidden, inter = ((4, 256, 128) if smoke else
                              (cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]))
    g = torch.Generator(device=device).manual_seed(0)

    def weights(count: int, dev: str):
        return [torch.randn(shape, generator=g if dev == device else None, device=dev, dtype=torch.bfloat16)
                for _ in range(count) for shape in ((inter, hidden), (inter, hidden), (hidden, inter))]

    layer = weights(experts, device)
    nbytes = sum(w.numel() * 2 for w in layer)
    mxfp4.quantize_mxfp4(layer[0])  # warm-up (kernel selection, compilation)
    _, seconds = _timed(device, lambda: [mxfp4.quantize_mxfp4(w) for w in layer])
    layer.clear()  # the weights freed before the CPU pass
    cpu_experts = min(experts, 2 if smoke else 8)
    cpu_layer = weights(cpu_experts, "cpu")
    cpu_bytes = sum(w.numel() * 2 for w in cpu_layer)
    mxfp4.quantize_mxfp4(cpu_layer[0])
    _, cpu_seconds = _timed("cpu", lambda: [mxfp4.quantize_mxfp4(w) for w in cpu_layer])
    rate, cpu_rate = nbytes / seconds, cpu_bytes / cpu_seconds
    return {"experts": experts, "hidden": hidden, "intermediate": inter, "layer_bytes": nbytes,
            "device_seconds": seconds, "device_bytes_per_s": rate,
            "cpu_experts_measured": cpu_experts, "cpu_seconds": cpu_seconds, "cpu_bytes_per_s": cpu_rate,
            "cpu_layer_seconds_extrapolated": nbytes / cpu_rate, "device_over_cpu": rate / cpu_rate}


# -- 3 and 4 ------------------------------------------------------------------------------------------------------
def _calibration_file(work: Path, tokens: int) -> Path:
    """A JSONL file of at least `tokens` characters (the toy tokenizer is byte-level), made of the trained toy's own
    arithmetic text repeated."""
    rows = [json.loads(line) for line in CALIB_TEXT.read_text().splitlines() if line.strip()]
    texts = [r.get("text") or " ".join(str(v) for v in r.values()) for r in rows]
    path = work / "calib.jsonl"
    written = 0
    with open(path, "w") as f:
        while written < tokens * 1.2:
            for t in texts:
                f.write(json.dumps({"text": t}) + "\n")
                written += len(t)
    return path


def _glm52_layer(work: Path, smoke: bool) -> Path:
    from quant.toy import build_toy

    if smoke:
        return build_toy("glm5", work / "layer", seed=0, overrides=dict(SMOKE_LAYER))
    cfg = json.loads(GLM52.read_text())
    overrides = {k: cfg[k] for k in GLM52_KEYS if k in cfg} | ONE_MOE_LAYER
    return build_toy("glm5", work / "layer", seed=0, overrides=overrides, shard_size="4GB")


def _gptq(src: Path, out: Path, device: str, settings, recipe: str = "all-linear") -> dict:
    import torch

    from quant.gptq.dry_run import predict
    from quant.pipeline import quantize_checkpoint

    predicted = predict(str(src), method="gptq", recipe=recipe, devices=device, settings=settings)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    manifest, seconds = _timed(device, lambda: quantize_checkpoint(
        src, out, method="gptq", recipe=recipe, gptq=settings, devices=device, check_engines=None,
        log=lambda m: print(f"   {m}", flush=True)))
    peak = torch.cuda.max_memory_allocated(device) if device.startswith("cuda") else None
    timing = manifest.get("timing", {})
    return {"device": device, "seconds": seconds,
            "phases_s": {k: v for k, v in timing.items() if k.startswith("gptq")},
            "peak_device_bytes": peak,
            "predicted_peak_bytes": {k: v for k, v in predicted.peaks.items()},
            "predicted_passes": predicted.passes,
            "export_bytes": sum(s["bytes"] for s in manifest["output"]["shards"].values())}


def gptq_layer(device: str, smoke: bool, work: Path) -> dict:
    from quant.gptq import CalibrationSettings, GptqSettings

    samples, seq_len = (4, 64) if smoke else (CalibrationSettings.samples, CalibrationSettings.seq_len)
    src, build_s = _timed("cpu", lambda: _glm52_layer(work, smoke))
    calib = _calibration_file(work, samples * seq_len)
    settings = GptqSettings(CalibrationSettings(str(calib), samples=samples, seq_len=seq_len))
    config = json.loads((src / "config.json").read_text())
    result = _gptq(src, work / "layer-gptq", device, settings)
    return {"build_s": build_s, "calibration_tokens": samples * seq_len,
            "layer": {k: config.get(k) for k in GLM52_KEYS}, **result}


def gptq_toy(device: str, smoke: bool, work: Path) -> dict:
    """The CPU tests' GPTQ (the glm5 toy, 32 windows of 32 tokens; 8 with --cpu-smoke) on the device and on the
    CPU."""
    from quant.gptq import CalibrationSettings, GptqSettings
    from quant.toy import build_toy

    src = build_toy("glm5", work / "toy", seed=0)
    settings = GptqSettings(CalibrationSettings(str(CALIB_TEXT), samples=8 if smoke else 32, seq_len=32), batch=8)
    runs = {"cpu": _gptq(src, work / "toy-cpu", "cpu", settings)}
    if device != "cpu":
        runs[device] = _gptq(src, work / "toy-dev", device, settings)
    return runs


# -- the run ------------------------------------------------------------------------------------------------------
def machine(device: str) -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "device": device}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda)
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="toy width on the CPU (what make test runs)")
    parser.add_argument("--out", type=Path, default=Path("device-check.json"))
    parser.add_argument("--work", type=Path, help="scratch directory (default: a temporary one)")
    parser.add_argument("--steps", default="cuda_tests,rtn_throughput,gptq_layer,gptq_toy")
    args = parser.parse_args(argv)
    import torch

    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        print("error: no CUDA device visible (use --cpu-smoke on a machine without one)", file=sys.stderr)
        return 2
    device = "cpu" if smoke else "cuda:0"
    work = args.work or Path(tempfile.mkdtemp(prefix="device-check-"))
    work.mkdir(parents=True, exist_ok=True)
    steps = {"cuda_tests": lambda: cuda_tests(smoke), "rtn_throughput": lambda: rtn_throughput(device, smoke),
             "gptq_layer": lambda: gptq_layer(device, smoke, work / "layer"),
             "gptq_toy": lambda: gptq_toy(device, smoke, work / "toy")}
    report = {"mode": "cpu-smoke" if smoke else "device", "machine": machine(device), "steps": {}}
    failed = 0
    for name in [s for s in args.steps.split(",") if s]:
        print(f"== {name}", flush=True)
        (work / name).mkdir(exist_ok=True)
        t0 = time.perf_counter()
        try:
            report["steps"][name] = {"ok": True, **steps[name]()}
        except Exception as e:  # noqa: BLE001  (each step's failure is recorded; the next step still runs)
            failed += 1
            report["steps"][name] = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                                     "traceback": traceback.format_exc()[-3000:]}
        report["steps"][name]["wall_s"] = time.perf_counter() - t0
        args.out.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")  # what is done so far, kept
        print(f"   {'ok' if report['steps'][name]['ok'] else 'FAILED: ' + report['steps'][name]['error']} "
              f"({report['steps'][name]['wall_s']:.1f} s)", flush=True)
    print(f"wrote {args.out}: {len(report['steps']) - failed} step(s) ok, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
