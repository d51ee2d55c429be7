"""`quant search --dry-run`: the streamed Fisher estimate's cost, predicted from config.json alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from quant.search.cost import search_cost

ROOT = Path(__file__).resolve().parent.parent
GLM52 = ROOT / "tests/data/glm52_config"


def test_dry_run_glm52_config_only_scales_with_samples():
    assert [p.name for p in GLM52.iterdir()] == ["config.json"]  # no weights to read
    one = search_cost(GLM52, samples=16, seq_len=128, engines=["vllm"])
    two = search_cost(GLM52, samples=32, seq_len=128, engines=["vllm"])
    t1, t2 = one.totals(), two.totals()
    assert t1["layers"] == 78
    assert all(v > 0 for v in t1.values())
    assert all(la.options > 0 and la.active > 0 for la in one.layers)
    assert t2["flops"] == 2 * t1["flops"]
    assert t2["kept_inputs_bytes"] == 2 * t1["kept_inputs_bytes"]
    assert t2["read_bytes"] == t1["read_bytes"]  # the weights are read the same, whatever the calibration
    assert t1["passes"] == t2["passes"] == sum(4 + la.options for la in one.layers)
    # a MoE layer's token runs the top-k of its experts: far fewer parameters than the layer holds
    moe = one.layers[-1]
    assert moe.active < moe.params / 10


@pytest.mark.slow
def test_dry_run_command_writes_nothing(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "quant", "search", str(GLM52), "--dry-run", "--engine", "vllm"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "total:" in proc.stdout and "FLOP" in proc.stdout and "host peak" in proc.stdout
    assert list(tmp_path.iterdir()) == []
    assert [p.name for p in GLM52.iterdir()] == ["config.json"]


def test_search_without_out_or_dry_run_is_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "quant", "search", str(GLM52), "--bits", "6"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "give --out RECIPE.yaml" in proc.stderr + proc.stdout
    assert list(tmp_path.iterdir()) == []
