"""Config values of the wrong type or range are one line naming the key, exit 2, in quantize and the preflight,
before any work (regressions from the hostile-input report)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

QUANT = [sys.executable, "-m", "quant.cli"]
CASES = [
    ("num_hidden_layers", "two", "'num_hidden_layers' must be an integer, got 'two'"),
    ("num_hidden_layers", None, "'num_hidden_layers' must be an integer, got None"),
    ("num_hidden_layers", 0, "'num_hidden_layers' must be at least 1, got 0"),
    ("num_nextn_predict_layers", [1, 2], "'num_nextn_predict_layers' must be an integer"),
    ("num_nextn_predict_layers", 1_000_000, "'num_nextn_predict_layers' is 1000000, more layers than"),
    ("n_shared_experts", "x", "'n_shared_experts' must be an integer, got 'x'"),
    ("architectures", 1.5, "'architectures' must be a non-empty list of class names"),
    ("quantization_config", "fp8", "'quantization_config' must be an object, got 'fp8'"),
    ("model_type", ["glm_moe_dsa"], "'model_type' must be a string"),
]


@pytest.mark.parametrize("key,value,message", CASES, ids=[f"{k}={v!r}" for k, v, _ in CASES])
@pytest.mark.parametrize("command", ["quantize", "verify-manifest"])
def test_bad_config_value_is_one_line_exit_2(toy_factory, tmp_path, key, value, message, command):
    bad = tmp_path / "bad"
    shutil.copytree(toy_factory("glm5"), bad)
    config = json.loads((bad / "config.json").read_text())
    config[key] = value
    (bad / "config.json").write_text(json.dumps(config))
    args = [command, str(bad)] + ([str(tmp_path / "out"), "--no-progress"] if command == "quantize" else [])
    result = subprocess.run(QUANT + args, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [f"error: {bad / 'config.json'}: {message}"] or \
        (len(result.stderr.strip().splitlines()) == 1 and message in result.stderr), result.stderr
    assert not (tmp_path / "out").exists()
