"""Seeded fuzzing of the checkpoint readers: mutate a small quantized export's config.json, Quark config,
index and shard headers, and run quantize's planning and the preflight on each mutant.

    python scripts/fuzz_preflight.py [--cases 10000] [--seed 0] [--timeout 20] [--memory-mb 1024] [--cli-every 100]

A case passes when the tool answers with a result or a QuantError within the time limit and the memory bound
(the address space may grow by at most --memory-mb while the case runs: a config value must not size the work);
anything else (another exception, a hang, MemoryError) is a crash, printed with the mutation that caused it.
Every --cli-every-th case also runs `quant verify-manifest` as a user would and checks its exit code against the
README (0 pass, 1 an engine would fail, 2 cannot be read) and against the in-process outcome, with at most one
`error:` line and no traceback. tests/test_fuzz.py runs a few hundred cases.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WEIRD = [None, True, -1, 0, 10**12, 1.5, float("nan"), "", "x", [], [1, 2], {}, {"a": 1}, "re:(", "*", "model"]
CONFIG_KEYS = ["num_hidden_layers", "num_nextn_predict_layers", "n_shared_experts", "n_routed_experts",
               "hidden_size", "moe_intermediate_size", "architectures", "model_type", "quantization_config",
               "first_k_dense_replace", "q_lora_rank", "kv_lora_rank", "text_config", "num_attention_heads"]
QUARK_KEYS = ["exclude", "layer_quant_config", "global_quant_config", "layer_type_quant_config", "export",
              "quant_method"]


def mutate_config(config: dict, rng: random.Random) -> str:
    roll = rng.random()
    q = config.get("quantization_config")
    if roll < 0.4:
        key = rng.choice(CONFIG_KEYS)
        config[key] = copy.deepcopy(rng.choice(WEIRD))
        return f"config[{key}] = {config[key]!r}"
    if roll < 0.5:
        key = rng.choice(CONFIG_KEYS)
        config.pop(key, None)
        return f"del config[{key}]"
    if not isinstance(q, dict):
        return "no quark config"
    if roll < 0.7:
        key = rng.choice(QUARK_KEYS)
        q[key] = copy.deepcopy(rng.choice(WEIRD))
        return f"quark[{key}] = {q[key]!r}"
    if roll < 0.8 and isinstance(q.get("exclude"), list) and q["exclude"]:
        i = rng.randrange(len(q["exclude"]))
        q["exclude"][i] = copy.deepcopy(rng.choice(WEIRD))
        return f"quark.exclude[{i}] = {q['exclude'][i]!r}"
    g = q.get("global_quant_config")
    if isinstance(g, dict):
        key = rng.choice(["input_tensors", "weight", "output_tensors", "bias"])
        sub = g.get(key)
        if isinstance(sub, dict) and rng.random() < 0.5:
            field = rng.choice(["dtype", "qscheme", "group_size", "is_dynamic", "scale_format", "ch_axis"])
            sub[field] = copy.deepcopy(rng.choice(WEIRD))
            return f"quark.global.{key}.{field} = {sub[field]!r}"
        g[key] = copy.deepcopy(rng.choice(WEIRD))
        return f"quark.global.{key} = {g[key]!r}"
    return "noop"


def mutate_index(index: dict, rng: random.Random) -> str:
    wm = index.get("weight_map")
    roll = rng.random()
    if roll < 0.3 or not isinstance(wm, dict) or not wm:
        index["weight_map"] = copy.deepcopy(rng.choice(WEIRD))
        return f"index.weight_map = {index['weight_map']!r}"
    name = rng.choice(sorted(wm))
    if roll < 0.6:
        wm[name] = rng.choice(["../x.safetensors", "missing.safetensors", "/etc/passwd", 7])
        return f"index[{name}] -> {wm[name]!r}"
    del wm[name]
    return f"del index[{name}]"


def mutate_shard(path: Path, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    n = struct.unpack("<Q", data[:8])[0] if len(data) >= 8 else 0
    try:
        header = json.loads(data[8:8 + n]) if 0 < n <= len(data) - 8 else None
    except ValueError:
        header = None  # an earlier mutation of this case already broke it
    roll = rng.random()
    if roll < 0.25 or not isinstance(header, dict) or len(header) < 2:
        cut = rng.randrange(0, max(1, len(data)))
        path.write_bytes(bytes(data[:cut]))
        return f"truncate {path.name} at {cut}"
    if roll < 0.4:
        pos = rng.randrange(8, 8 + n)
        data[pos] = rng.randrange(256)
        path.write_bytes(bytes(data))
        return f"flip header byte {pos}"
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    entry = header[name]
    field = rng.choice(["dtype", "shape", "drop"])
    if field == "dtype":
        entry["dtype"] = rng.choice(["BF16", "U8", "F8_E4M3", "F32", "I64", "BOOL", "F8_E8M0"])
    elif field == "shape":
        shape = entry["shape"]
        entry["shape"] = rng.choice([[], [0], shape[:1], shape + [1], [shape[0] * 2] + shape[1:], [0] + shape[1:]])
    else:
        del header[name]
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    # Offsets still refer to the old layout; safetensors refuses a mismatch, which is part of what is tested.
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(data[8 + n:]))
    return f"header {name}.{field} -> {entry.get(field, 'dropped')}"


def run_case(base: Path, work: Path, rng: random.Random) -> str:
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(base, work)
    what = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        target = rng.random()
        if target < 0.5:
            config = json.loads((work / "config.json").read_text())
            what.append(mutate_config(config, rng))
            (work / "config.json").write_text(json.dumps(config))
        elif target < 0.7 and (work / "model.safetensors.index.json").exists():
            index = json.loads((work / "model.safetensors.index.json").read_text())
            what.append(mutate_index(index, rng))
            (work / "model.safetensors.index.json").write_text(json.dumps(index))
        else:
            shard = rng.choice(sorted(work.glob("*.safetensors")))
            what.append(mutate_shard(shard, rng))
    return "; ".join(what)


class Hang(Exception):
    pass


def check(work: Path) -> int:
    """The tool's readers on one mutant: the preflight for every engine, then quantize's planning. Returns the
    exit code `quant verify-manifest` must give for it."""
    from quant.checkpoint import open_checkpoint
    from quant.errors import QuantError
    from quant.planning.plan import make_plan
    from quant.planning.recipes import family_for_config, load_recipe
    from quant.planning.schemes import get_scheme
    from quant.verify import verify_checkpoint

    try:
        code = verify_checkpoint(work, engines=["all"]).exit_code
    except QuantError as e:
        code = e.exit_code
    try:
        ckpt = open_checkpoint(work)
        make_plan(ckpt, family_for_config(ckpt.config), load_recipe(None), get_scheme("w_mxfp4_a_mxfp4"), "even")
    except QuantError:
        pass
    return code


def check_cli(work: Path, expected: int) -> str | None:
    """What is wrong with `quant verify-manifest` on the mutant, as a user runs it; None when nothing is."""
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "quant.cli", "verify-manifest", str(work), "--engine", "all"],
                          capture_output=True, text=True, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    if "Traceback" in proc.stderr or len(errors) > 1:
        return f"cli printed more than one error line: {proc.stderr[-300:]!r}"
    if proc.returncode != expected or proc.returncode not in (0, 1, 2):
        return f"cli exit {proc.returncode}, expected {expected} ({(errors or [''])[0][:200]})"
    return None


class _AddressSpace:
    """Cap the address space at its current size plus `extra_mb` for the cases (MemoryError beyond it), and
    give the old limit back afterwards. Linux only; elsewhere no cap."""

    def __init__(self, extra_mb: int):
        self.extra = extra_mb << 20

    def __enter__(self):
        try:
            import resource

            self.resource = resource
            self.old = resource.getrlimit(resource.RLIMIT_AS)
            with open("/proc/self/statm") as f:
                size = int(f.read().split()[0]) * resource.getpagesize()
            cap = size + self.extra
            if self.old[1] == resource.RLIM_INFINITY or cap < self.old[1]:
                resource.setrlimit(resource.RLIMIT_AS, (cap, self.old[1]))
        except (ImportError, OSError, ValueError):
            self.resource = None
        return self

    def __exit__(self, *exc):
        if self.resource:
            self.resource.setrlimit(self.resource.RLIMIT_AS, self.old)


def build_base(root: Path) -> Path:
    from quant.pipeline import quantize_checkpoint
    from quant.toy import build_toy

    src = build_toy("glm5", root / "src", shard_size=900_000)
    quantize_checkpoint(src, root / "base", check_engines=None, log=lambda m: None)
    return root / "base"


def fuzz(cases: int, seed: int, timeout: float, memory_mb: int = 1024, cli_every: int = 0, log=print) -> dict:
    import resource

    rng = random.Random(seed)
    crashes = []
    started = time.perf_counter()
    cli_runs = 0

    def alarm(*_):
        raise Hang()

    signal.signal(signal.SIGALRM, alarm)
    with tempfile.TemporaryDirectory() as tmp:
        base = build_base(Path(tmp))
        check(base)  # warm the imports before the address space is capped
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with _AddressSpace(memory_mb):
            for i in range(cases):
                what = run_case(base, Path(tmp) / "case", rng)
                signal.setitimer(signal.ITIMER_REAL, timeout)
                try:
                    expected = check(Path(tmp) / "case")
                except Hang:
                    crashes.append((i, what, "hang"))
                    continue
                except MemoryError:
                    crashes.append((i, what, f"MemoryError: more than {memory_mb} MB"))
                    continue
                except Exception as e:  # the finding: anything but a one-line QuantError
                    crashes.append((i, what, "".join(traceback.format_exception_only(type(e), e)).strip()))
                    continue
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                if cli_every and i % cli_every == 0:
                    cli_runs += 1
                    problem = check_cli(Path(tmp) / "case", expected)
                    if problem:
                        crashes.append((i, what, problem))
        peak_growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    return {"cases": cases, "crashes": crashes, "seconds": time.perf_counter() - started, "cli_runs": cli_runs,
            "peak_rss_growth_mb": peak_growth}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds a case may take before it is a hang")
    parser.add_argument("--memory-mb", type=int, default=1024, help="address space a case may add")
    parser.add_argument("--cli-every", type=int, default=100, help="run the CLI on every N-th case (0: never)")
    args = parser.parse_args()
    result = fuzz(args.cases, args.seed, args.timeout, args.memory_mb, args.cli_every)
    for i, what, error in result["crashes"][:50]:
        print(f"case {i}: {what}\n    {error}")
    print(f"{result['cases']} cases ({result['cli_runs']} also through the CLI), {len(result['crashes'])} crashes, "
          f"peak RSS +{result['peak_rss_growth_mb']:.0f} MB, {result['seconds']:.0f} s")
    return 1 if result["crashes"] else 0


if __name__ == "__main__":
    sys.exit(main())
