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
    ("model_type", ["glm_moe_dsa"], "'model_type' must be a non-empty string"),
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


def _toy_copy(toy_factory, tmp_path, edit=None, family="glm5"):
    bad = tmp_path / "bad"
    shutil.copytree(toy_factory(family), bad)
    if edit:
        config = json.loads((bad / "config.json").read_text())
        edit(config)
        (bad / "config.json").write_text(json.dumps(config))
    return bad


def _run(command, ckpt, tmp_path):
    args = [command, str(ckpt)] + ([str(tmp_path / "out"), "--no-progress"] if command == "quantize" else [])
    return subprocess.run(QUANT + args, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", ["quantize", "verify-manifest"])
def test_missing_model_type_is_not_a_checkpoint(toy_factory, tmp_path, command):
    """transformers' AutoConfig refuses a config.json without model_type; so do we, before any work."""
    bad = _toy_copy(toy_factory, tmp_path, lambda c: c.pop("model_type"))
    result = _run(command, bad, tmp_path)
    assert result.returncode == 2 and "no 'model_type'" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["quantize", "verify-manifest"])
def test_unknown_model_type_would_fail_every_engine(toy_factory, tmp_path, command):
    """A model_type no AutoConfig knows is an engine failure (exit 1), named as such."""
    bad = _toy_copy(toy_factory, tmp_path, lambda c: c.update(model_type="glm_moe_dsx"))
    result = _run(command, bad, tmp_path)
    assert result.returncode == 1, result.stderr + result.stdout
    assert "glm_moe_dsx" in (result.stderr + result.stdout)
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("*.safetensors"))


@pytest.mark.parametrize("command", ["quantize", "verify-manifest"])
def test_more_declared_layers_than_stored_is_an_engine_failure(toy_factory, tmp_path, command):
    """num_hidden_layers larger than the layers the tensors hold: every engine builds the declared layers and
    has nothing to load into the missing ones (the former MTP layer would also be taken for a decoder layer)."""
    bad = _toy_copy(toy_factory, tmp_path, lambda c: c.update(num_hidden_layers=c["num_hidden_layers"] + 3))
    result = _run(command, bad, tmp_path)
    assert result.returncode == 1, result.stderr + result.stdout
    assert "num_hidden_layers" in (result.stderr + result.stdout)


def test_quark_tensor_spec_of_the_wrong_type(toy_factory, tmp_path):
    from quant.pipeline import quantize_checkpoint

    out = tmp_path / "q"
    quantize_checkpoint(toy_factory("glm5"), out, check_engines=None)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["global_quant_config"]["input_tensors"] = "x"
    (out / "config.json").write_text(json.dumps(config))
    result = _run("verify-manifest", out, tmp_path)
    assert result.returncode == 2, result.stderr
    assert "global_quant_config.input_tensors must be null, an object or a list" in result.stderr


@pytest.mark.parametrize("damage", ["truncated", "broken-header"])
def test_an_unreadable_shard_is_exit_2_in_the_preflight(toy_factory, tmp_path, damage):
    """README: exit 2 means the checkpoint cannot be read; a shard cut short or with a broken header is that,
    not an engine verdict."""
    from quant.pipeline import quantize_checkpoint

    out = tmp_path / "q"
    quantize_checkpoint(toy_factory("glm5"), out, check_engines=None)
    shard = sorted(out.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data[8:20] = b"{not json!!!"
    shard.write_bytes(bytes(data))
    result = _run("verify-manifest", out, tmp_path)
    assert result.returncode == 2, result.stdout[-2000:]
    assert shard.name in result.stdout
