"""Benchmark: `quant quantize` vs AMD Quark's file-to-file MXFP4 path on a synthetic GLM-5-shaped checkpoint.

Both run as whole processes on the same input, one after the other. Reported: wall time and its ratio, peak RSS
of each, the share of our time spent quantizing (the rest is reading, hashing and writing files), whether the
dequantized weights are identical (both use the `even` scale rule), the CPU capability the kernels ran with, and
our time as a multiple of the I/O floor measured in the same run (`io_floor`).

    .venv/bin/python scripts/bench_quantize.py [--gb 6] [--shards 8] [--runs 3] [--peer-runs 1] [--keep DIR]

Quark is measured only when `amd-quark` is importable by the peer's interpreter (`--peer-python`, default this one;
`make .venv-engines/.installed` gives one: `--peer-python .venv-engines/bin/python`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

EXPERT_BYTES = 3 * 2048 * 6144 * 2  # gate + up [2048, 6144] and down [6144, 2048], bf16
HIDDEN, MOE_INTER = 6144, 2048


def build_synthetic(root: Path, gb: float, shards: int) -> Path:
    """MoE layers of GLM-5 expert shapes (routed + one shared expert + router + norms)."""
    root.mkdir(parents=True)
    n_experts = max(shards, int(gb * 1e9 // EXPERT_BYTES))
    per_shard = -(-n_experts // shards)
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for s in range(shards):
        tensors = {}
        layer = s
        p = f"model.layers.{layer}."
        tensors[p + "input_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        # one shared expert and per_shard - 1 routed experts 0.. (as many router rows as config.json declares)
        tensors[p + "mlp.gate.weight"] = (torch.randn(per_shard - 1, HIDDEN, generator=gen) * 0.02).bfloat16()
        for e in range(per_shard):
            for proj, shape in (("gate_proj", (MOE_INTER, HIDDEN)), ("up_proj", (MOE_INTER, HIDDEN)),
                                ("down_proj", (HIDDEN, MOE_INTER))):
                name = f"{p}mlp.experts.{e - 1}.{proj}.weight" if e else f"{p}mlp.shared_experts.{proj}.weight"
                tensors[name] = (torch.randn(*shape, generator=gen) * 0.02).bfloat16()
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, str(root / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in tensors})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "hidden_size": HIDDEN,
              "moe_intermediate_size": MOE_INTER, "num_hidden_layers": shards, "n_routed_experts": per_shard - 1,
              "num_nextn_predict_layers": 0, "torch_dtype": "bfloat16"}
    (root / "config.json").write_text(json.dumps(config))
    return root


def settle(src: Path) -> None:
    """The same starting point for every timed run: dirty pages flushed (else the writeback of, say, the freshly
    built source throttles whichever process writes next to disk speed) and the source read once, so it is in
    the page cache (this VM drops a few percent of cached pages while idle, and re-reading them at random costs
    seconds)."""
    os.sync()
    buf = bytearray(1 << 24)
    for f in sorted(src.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def timed(cmd: list[str], src: Path, env: dict | None = None) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes of the process as the kernel counts it, stderr), from `settle`d state."""
    settle(src)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"command failed: {' '.join(cmd)}\n{err[-3000:]}")
    return wall, usage.ru_maxrss * 1024, err


QUARK_SCRIPT = """
import sys
from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import QConfig, QLayerConfig, OCP_MXFP4Spec
spec = OCP_MXFP4Spec(ch_axis=-1, is_dynamic=False).to_quantization_spec()
cfg = QConfig(global_quant_config=QLayerConfig(weight=spec), exclude=["*mlp.gate", "*norm*", "lm_head"])
ModelQuantizer(cfg).direct_quantize_checkpoint(sys.argv[1], sys.argv[2], device="cpu")
"""


def expert_names(ckpt: Path) -> dict[str, str]:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    return {n[: -len(".weight")]: f for n, f in index.items() if n.endswith("_proj.weight")}


def compare(ours: Path, quark: Path) -> tuple[int, int]:
    """(modules compared, modules whose dequantized weights differ)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from quant.numerics.mxfp4 import dequantize_mxfp4

    a, b = expert_names(ours), expert_names(quark)
    differ = 0
    for module in sorted(a):
        w = []
        for root, files in ((ours, a), (quark, b)):
            with safe_open(str(root / files[module]), "pt") as f:
                w.append(dequantize_mxfp4(f.get_tensor(module + ".weight"),
                                          f.get_tensor(module + ".weight_scale").view(torch.uint8), torch.float32))
        differ += not torch.equal(w[0], w[1])
    return len(a), differ


def io_floor(src: Path, out: Path, work: Path, window: int = 1 << 24) -> float:
    """Seconds this machine needs for the I/O every quantizer of these bytes must do: read each source shard (from
    the page cache, where the runs left it), sha256 over the source and over an output of the same size (the
    manifest's hashes), and write that many bytes into a new file. One thread, median of three."""
    import hashlib

    sources = sorted(src.glob("*.safetensors"))
    out_bytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        buffer = bytearray(window)
        view = memoryview(buffer)
        for f in sources:
            digest = hashlib.sha256()
            with open(f, "rb", buffering=0) as fh:
                while n := fh.readinto(buffer):
                    digest.update(view[:n])
        sink = work / "floor.bin"
        digest = hashlib.sha256()
        with open(sink, "wb", buffering=0) as fh:
            left = out_bytes
            while left:
                n = min(left, window)
                digest.update(view[:n])
                fh.write(view[:n])
                left -= n
        sink.unlink()
        times.append(time.perf_counter() - start)
    return sorted(times)[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 6 GB: both tools' start-up (torch import; Quark's ~25 s of setup) weighs less than at 3 GB, closer to the
    # per-GB cost that matters on real checkpoints; BENCHMARKS.md records both sizes.
    ap.add_argument("--gb", type=float, default=6.0, help="source size in GB (bf16)")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--keep", type=Path, help="work directory to keep (default: a temporary one)")
    ap.add_argument("--no-peer", action="store_true", help="measure only `quant quantize` (quick iterations)")
    ap.add_argument("--runs", type=int, default=3, help="runs of `quant quantize` (the median is reported)")
    ap.add_argument("--peer-runs", type=int, default=1, help="runs of Quark (the median is reported; ~80 s each)")
    ap.add_argument("--peer-python", default=sys.executable,
                    help="interpreter that has amd-quark==0.13 (e.g. .venv-engines/bin/python)")
    ap.add_argument("--cold", action="store_true", help="also time one run without the compiled-kernel cache")
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-quantize-"))
    src = build_synthetic(work / "src", args.gb, args.shards) if not (work / "src").exists() else work / "src"
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    print(f"source: {size / 1e9:.2f} GB in {args.shards} shards, expert shapes [2048, 6144] / [6144, 2048]; "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()} (ATEN_CPU_CAPABILITY picks it), "
          f"{os.cpu_count()} cores")

    build = time.perf_counter()
    kernels = subprocess.run([sys.executable, "-m", "quant.cli", "kernels", "build"], capture_output=True, text=True,
                             check=True).stderr.strip().splitlines()[-1]
    print(f"compiled kernels (one-time per machine, `quant kernels build`): {kernels}, "
          f"{time.perf_counter() - build:.1f} s")

    ours = work / "ours"
    quant = [sys.executable, "-m", "quant.cli", "quantize", str(src), str(ours), "--no-progress"]
    runs = []
    for _ in range(args.runs):
        shutil.rmtree(ours, ignore_errors=True)
        runs.append(timed(quant, src))
    t_ours, rss_ours, err = sorted(runs)[len(runs) // 2]  # the median run
    timing = next((line for line in err.splitlines() if line.startswith("time:")), "")
    parts = dict((k, float(v.rstrip("s"))) for k, v in (p.strip().split(" ") for p in timing[5:].split(",")))
    share = parts.get("quantize", 0) / t_ours
    print(f"quant quantize : {t_ours:7.2f} s  {size / t_ours / 1e9:6.2f} GB/s  peak RSS {rss_ours / 1e9:.2f} GB  "
          f"(median of {len(runs)}: {', '.join(f'{r[0]:.2f}' for r in runs)} s; quantize {parts.get('quantize', 0):.2f}"
          f" s = {share:.0%} of wall; {timing[6:]})")
    floor = io_floor(src, ours, work)
    print(f"I/O floor      : {floor:7.2f} s  (read the source from page cache, sha256 of source and output, write "
          f"the output's size, one thread); quant quantize = {t_ours / floor:.2f}x the floor")
    if args.cold:
        shutil.rmtree(ours, ignore_errors=True)
        t_cold, _, _ = timed(quant, src, env={**os.environ, "QUANT_NO_AOT": "1"})
        print(f"  without the compiled-kernel cache (torch.compile in the run): {t_cold:.2f} s")

    if args.no_peer:
        return
    if subprocess.run([args.peer_python, "-c", "import quark"], capture_output=True).returncode != 0:
        print(f"amd-quark not importable by {args.peer_python}: no peer measured (pip install amd-quark==0.13)")
        return
    qdir = work / "quark"
    peer = []
    for _ in range(args.peer_runs):
        shutil.rmtree(qdir, ignore_errors=True)
        peer.append(timed([args.peer_python, "-c", QUARK_SCRIPT, str(src), str(qdir)], src))
    t_q, rss_q, _ = sorted(peer)[len(peer) // 2]
    print(f"amd-quark 0.13 : {t_q:7.2f} s  {size / t_q / 1e9:6.2f} GB/s  peak RSS {rss_q / 1e9:.2f} GB  "
          f"(median of {len(peer)}: {', '.join(f'{r[0]:.2f}' for r in peer)} s)")
    n, differ = compare(ours, qdir)
    print(f"speed-up {t_q / t_ours:.1f}x; peak RSS ours/quark {rss_ours / rss_q:.2f}; "
          f"dequantized weights identical in {n - differ}/{n} modules")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
