"""scripts/bench_gptq_peers.py (issue #24): its command line, and the GLM-5.2 extrapolation's arithmetic on made-up
phase seconds (no benchmark is run; nothing here checks a measured time)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_gptq_peers.py"


def _script():
    from conftest import load_script

    return load_script("bench_gptq_peers")


def test_help_names_the_parts():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=True).stdout
    for flag in ("--seeds", "--no-llmc", "--with-autoround", "--experts", "--gpu-speedup", "--skip-phases"):
        assert flag in out


def test_extrapolation_scales_solves_by_experts_and_splits_them_among_gpus(capsys):
    from quant.gptq import CalibrationSettings

    bench = _script()
    dims = {"hidden_size": 6144, "moe_intermediate_size": 2048, "n_shared_experts": 1, "num_experts_per_tok": 4}
    timing = {"gptq_forward_s": 1.0, "gptq_hessians_s": 3.0, "gptq_solve_s": 50.0, "gptq_load_s": 1.0,
              "gptq_save_s": 1.0, "write_s": 2.0}
    calib = CalibrationSettings(str(SCRIPT), samples=16, seq_len=256)
    bench.extrapolate(timing, dims, 4, calib, 8, None)
    out = capsys.readouterr().out
    assert "per expert: solve 10.0 s" in out  # 50 s over 4 routed + 1 shared
    assert "per layer, solve (1 worker): 2570 s" in out  # 10 s x (256 + 1)
    assert "Hessian passes per layer: 11" in out  # 4 GiB / 168 MiB per expert = 24 experts a pass
    assert "unmeasured (set --gpu-speedup)" in out
