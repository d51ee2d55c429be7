"""scripts/bench_gptq_ranks.py (issue #34): its command line, and the GLM-5.2 extrapolation's arithmetic on made-up
phase seconds (no benchmark is run here: tests/test_gptq_ranks.py runs the ranks themselves)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_gptq_ranks.py"


def _script():
    from conftest import load_script

    return load_script("bench_gptq_ranks")


def test_help_names_the_parts():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=True).stdout
    for flag in ("--ranks", "--scale", "--experts", "--repeat", "--gpus", "--gpu-speedup", "--link-gbs"):
        assert flag in out


def _run(forward: float, hessians: float, solve: float) -> dict:
    cpu = {"forward": forward, "hessians": hessians, "solve": solve, "apply": 0.0, "comm": 0.0}
    return {"cpu": cpu, "phase": dict(cpu), "wall": 1.0}


def test_extrapolation_shares_the_forward_by_its_measured_scaling_and_the_units_by_the_runs_assignment(capsys):
    bench = _script()
    dims = {"hidden_size": 768, "moe_intermediate_size": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
            "n_routed_experts": 64, "q_lora_rank": 256, "kv_lora_rank": 64, "num_attention_heads": 8,
            "index_n_heads": 4}
    args = argparse.Namespace(samples=32, seq_len=128, gpus=8, link_gbs=10.0, gpu_speedup=None)
    one, two = _run(1.0, 3.0, 20.0), _run(0.5, 2.0, 15.0)  # the forward halves on 2 ranks: no serial part
    bench.extrapolate(one, {1: one, 2: two}, dims, args)
    out = capsys.readouterr().out
    assert "12 forwards (11 Hessian passes at the 4 GiB budget + 1)" in out
    assert "forward's serial fraction 0.00 (from its 2.00x on 2 ranks)" in out
    assert "the slowest rank's share 0.125 of 515 units, ideal 0.125" in out  # 256 gate_up + 256 down + 3 shared
    assert "2 sweep(s) of the owned Hessians" in out  # 32 experts a rank x 160 MiB > 4 GiB
    slow = _run(1.0, 3.0, 20.0)
    bench.extrapolate(one, {1: one, 2: slow}, dims, args)  # no gain on 2 ranks: the forward taken serial
    assert "forward's serial fraction 1.00 (from its 1.00x on 2 ranks)" in capsys.readouterr().out
