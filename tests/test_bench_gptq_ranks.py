"""scripts/bench_gptq_ranks.py (issue #34): its command line, the GLM-5.2 extrapolation's arithmetic on made-up
phase seconds, and the per-rank timing records it reads: written by the hook tests/gptq_faults/sitecustomize.py
installs in each rank (around quant.gptq.run's report_run; the package reads no timing variable). The slow test
runs the benchmark's own `run` on a tiny layer on 1 and 2 ranks (tests/test_gptq_ranks.py tests the ranks
themselves)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "bench_gptq_ranks.py"


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


def test_the_package_reads_no_timing_variable_and_holds_no_hook():
    from gptq_faults.sitecustomize import KILL_ENV, TIMING_ENV

    from quant.gptq import loop, progress

    assert not hasattr(progress, "on_run_end") and not hasattr(loop, "on_layer_start")
    for path in (REPO / "quant").rglob("*.py"):
        assert TIMING_ENV not in path.read_text() and KILL_ENV not in path.read_text(), path


def test_the_timing_record_of_a_rank():
    from quant.gptq import progress
    from quant.gptq.ranks import Ranks

    timing = Counter({"gptq_solve_s": 2.0, "cpu:gptq_solve_s": 1.5, "gptq_forward_s": 0.5})
    lines = []
    progress.report_run(lines.append, Ranks(0, 1, sent=7), timing, 2, 0, (4, 8), 3.0, 0.25)
    assert len(lines) == 1
    record = progress.timing_record(Ranks(0, 1, sent=7), timing, 0.25)
    assert record["rank"] == 0 and record["ranks"] == 1 and record["sent"] == 7 and record["received"] == 0
    assert set(record["wall_s"]) == set(progress.PHASES) and record["wall_s"]["gptq_solve_s"] == 2.0
    assert record["cpu_s"] == {"gptq_solve_s": 1.5, "gptq_comm_s": 0.25}


def test_the_timing_hook_is_installed_in_a_fresh_process_by_the_benchmarks_environment(tmp_path):
    """`timing_env` (what the benchmark gives its subprocesses) alone makes a process's run write PREFIX.RANK."""
    bench = _script()
    code = ("from collections import Counter; from quant.gptq import run; from quant.gptq.ranks import Ranks; "
            "run.report_run(print, Ranks(0, 1), Counter({'gptq_solve_s': 1.0}), 1, 0, (1, 1), 1.0, 0.0)")
    prefix = tmp_path / "timing"
    env = {k: v for k, v in os.environ.items() if k not in ("QUANT_GPTQ_TIMING", "QUANT_GPTQ_KILL")}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=env, capture_output=True)
    assert not list(tmp_path.iterdir())  # without it: no file
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env={**env, **bench.timing_env(prefix)},
                   capture_output=True)
    record = json.loads(Path(f"{prefix}.0").read_text())
    assert record["rank"] == 0 and record["wall_s"]["gptq_solve_s"] == 1.0


@pytest.mark.slow
@pytest.mark.xdist_group("gptq-ranks")  # several processes: one xdist worker runs them in turn
def test_the_benchmark_reads_each_ranks_record_of_a_real_run(tmp_path):
    bench = _script()
    src, _ = bench.layer_toy(tmp_path, 32, 8)
    args = argparse.Namespace(samples=8, seq_len=16, threads=1)
    for ranks in (1, 2):
        result = bench.run(src, tmp_path / f"out-{ranks}", ranks, args)
        records = sorted(tmp_path.glob(f"timing-{ranks}.*"))
        assert [p.name for p in records] == [f"timing-{ranks}.{r}" for r in range(ranks)]
        assert all(len(v) == ranks for v in result["per_rank"].values())
        assert result["phase"]["solve"] > 0 and result["cpu"]["solve"] > 0
        assert (result["sent"] > 0) == (ranks > 1)
    assert bench.same_bytes(tmp_path / "out-1", tmp_path / "out-2")
