"""Benchmark `quant verify-manifest ORG/NAME` (the Hub preflight): requests and bytes it fetches against the
repository's size.

Repositories, served by tests/hub_server.py (the Hub's endpoints on 127.0.0.1; the client is the real
`python -m quant.cli` with HF_ENDPOINT pointing at it):
  1. toy: `quant toy glm5 --shard-size 100KB` quantized with `quant quantize` (tens of shards, real data), read
     cold (empty HF_HOME: config.json and the index downloaded), warm (both cached) and with --scales;
  2. glm5.2: a header-only Quark MXFP4 export at GLM-5.2 scale (~118k tensors over 140 shards, sparse files of
     the real sizes; scripts/bench_verify.py's layout), read cold.
For each: exit code, requests and response bytes as the client counts them (and the server, which must agree),
the repository's size, the ratio, and the wall time of the whole process.

    .venv/bin/python scripts/bench_hub_preflight.py [--work DIR] [--shard-size 100KB] [--skip-large]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from hub_server import HubServer  # noqa: E402


def build_toy(work: Path, shard_size: str) -> Path:
    src, out = work / f"toy-{shard_size}", work / f"toy-{shard_size}-mxfp4"
    if not (out / "config.json").is_file():
        quant = [sys.executable, "-m", "quant.cli"]
        for cmd in (["toy", "glm5", str(src), "--shard-size", shard_size, "--overwrite"],
                    ["quantize", str(src), str(out), "--overwrite"]):
            r = subprocess.run(quant + cmd, capture_output=True, text=True)
            if r.returncode:
                sys.exit(f"quant {' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()}")
    return out


def build_large(work: Path, shards: int = 140) -> Path:
    from synthetic import glm_moe_dsa_config, glm_moe_dsa_layout, quark_layout, write_checkpoint

    out = work / "glm52-headers"
    if not (out / "config.json").is_file():
        cfg = glm_moe_dsa_config(78, hidden=6144, experts=256, moe_inter=2048, inter=12288, heads=64, q_lora=2048,
                                 kv_lora=512, nope=192, rope=64, v_head=256, index_heads=32, index_dim=128,
                                 first_k_dense=3)
        cfg["vocab_size"] = 154880
        tensors, qcfg = quark_layout(cfg, glm_moe_dsa_layout(cfg))
        write_checkpoint(out, qcfg, tensors, shards=shards)
    return out


def run(server: HubServer, home: Path, *args: str) -> dict:
    server.reset()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_ENDPOINT=server.url, HF_HUB_OFFLINE="0", HF_HOME=str(home))
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "quant.cli", "verify-manifest", *args, "--json"], cwd=REPO, env=env,
                       capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode not in (0, 1):
        sys.exit(f"verify-manifest {' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
    data = json.loads(r.stdout)
    hub = data["hub"]
    assert (hub["requests"], hub["bytes"]) == (server.stats.requests, server.stats.bytes), (hub, server.stats)
    return {"exit": r.returncode, "wall_s": round(wall, 2), **hub, "scales": data.get("scales"),
            "errors": data["errors"], "warnings": data["warnings"]}


def show(label: str, shards: int, m: dict) -> None:
    ratio = m["bytes"] / m["repo_bytes"]
    scales = f"; scales {m['scales']['tensors']} tensors, {m['scales']['bytes']} B" if m["scales"] else ""
    print(f"{label:<22} {shards:>4} shards  {m['requests']:>6} requests  {m['bytes']:>10,} B of "
          f"{m['repo_bytes']:>16,} B = {100 * ratio:.4f} %  exit {m['exit']}  {m['wall_s']:.2f} s{scales}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=None, help="where the repositories are built (kept)")
    ap.add_argument("--shard-size", default="100KB")
    ap.add_argument("--skip-large", action="store_true", help="only the toy")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-hub-"))
    work.mkdir(parents=True, exist_ok=True)
    toy = build_toy(work, args.shard_size)
    server = HubServer().start()
    server.add_repo("bench/toy", toy)
    toy_shards = len(list(toy.glob("*.safetensors")))
    with tempfile.TemporaryDirectory() as home:
        home = Path(home)
        show("toy cold", toy_shards, run(server, home, "bench/toy"))
        show("toy warm", toy_shards, run(server, home, "bench/toy"))
        show("toy warm --scales", toy_shards, run(server, home, "bench/toy", "--scales"))
        if not args.skip_large:
            large = build_large(work)
            server.add_repo("bench/glm52", large)
            show("glm5.2 headers cold", len(list(large.glob("*.safetensors"))), run(server, home, "bench/glm52"))
    server.stop()


if __name__ == "__main__":
    main()
