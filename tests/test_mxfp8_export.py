"""MXFP8 as a target (issue #31): the w_mxfp8_a_mxfp8 scheme and the mixed layouts AMD publishes (MXFP4 experts with
MXFP8 elsewhere: recipe experts-mxfp4-rest-mxfp8; MXFP4 experts with FP8 attention: experts-mxfp4-attn-fp8), written
as Quark QLayerConfigs (quant/pipeline/quark_config.py) and stored as the engines read them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from quant.dequant import dequantize_state
from quant.errors import QuantError
from quant.numerics import mxfp8
from quant.pipeline import quantize_checkpoint
from quant.pipeline.quark_config import layer_config

Q_PROJ = "model.layers.0.self_attn.q_proj"
EXPERT = "model.layers.0.mlp.experts.0.down_proj"


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from quant.toy import build_toy

    return build_toy("qwen3-moe", tmp_path_factory.mktemp("mx8") / "src", seed=0)


def _export(src, out, **kwargs):
    quantize_checkpoint(src, out, check_engines="", log=lambda m: None, **kwargs)
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    return q, load_file(out / "model.safetensors"), json.loads((out / "quant_manifest.json").read_text())


def test_mxfp4_experts_mxfp8_elsewhere(toy, tmp_path):
    q, tensors, manifest = _export(toy, tmp_path / "out", recipe="experts-mxfp4-rest-mxfp8")
    assert q["global_quant_config"] == layer_config("w_mxfp4_a_mxfp4", "even")
    assert q["layer_quant_config"] == {f"*self_attn.{p}": layer_config("w_mxfp8_a_mxfp8", "even")
                                       for p in ("k_proj", "o_proj", "q_proj", "v_proj")}
    w, s = tensors[Q_PROJ + ".weight"], tensors[Q_PROJ + ".weight_scale"]
    assert (w.dtype, s.dtype, s.shape[-1] * 32) == (torch.float8_e4m3fn, torch.uint8, w.shape[-1])
    assert tensors[EXPERT + ".weight"].dtype == torch.uint8  # MXFP4 packed
    assert manifest["tensors"][Q_PROJ]["scheme"] == "w_mxfp8_a_mxfp8"
    source = load_file(toy / "model.safetensors")[Q_PROJ + ".weight"]
    want_q, want_s = mxfp8.quantize_mxfp8(source, "even")
    assert torch.equal(w.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
    back = dequantize_state({k: v for k, v in tensors.items() if k.startswith(Q_PROJ)}, torch.float32)
    assert torch.equal(back[Q_PROJ + ".weight"], mxfp8.dequantize_mxfp8(want_q, want_s))


def test_mxfp8_as_the_scheme(toy, tmp_path):
    q, tensors, _ = _export(toy, tmp_path / "out", scheme="w_mxfp8_a_mxfp8", recipe="all-linear")
    assert q["global_quant_config"]["weight"]["dtype"] == "fp8_e4m3"
    assert q["global_quant_config"]["input_tensors"]["is_dynamic"] is True
    assert tensors[EXPERT + ".weight"].dtype == torch.float8_e4m3fn


def test_mxfp4_experts_fp8_attention(toy, tmp_path):
    q, tensors, _ = _export(toy, tmp_path / "out", recipe="experts-mxfp4-attn-fp8")
    assert q["layer_quant_config"] and all(v == layer_config("fp8", "even") for v in q["layer_quant_config"].values())
    assert tensors[Q_PROJ + ".weight"].dtype == torch.float8_e4m3fn
    assert tensors[Q_PROJ + ".weight_scale"].dtype == torch.float32  # per-channel FP8, not MXFP8


def test_mxfp8_roles_need_a_quark_scheme(toy, tmp_path):
    with pytest.raises(QuantError, match="mxfp8.*needs a Quark scheme"):
        _export(toy, tmp_path / "out", scheme="fp8-block", recipe="experts-mxfp4-rest-mxfp8")


def test_scale_mode_search_falls_back_to_even_for_mxfp8():
    from quant.planning.schemes import mxfp8_scale_mode

    assert [mxfp8_scale_mode(m) for m in ("even", "floor", "rceil", "search")] == ["even", "floor", "rceil", "even"]
    assert layer_config("w_mxfp8_a_mxfp8", "rceil")["weight"]["scale_calculation_mode"] is None  # Quark has no rceil


def test_a_mixed_recipe_is_self_checked_on_the_engines_that_load_every_scheme_it_writes(toy, tmp_path):
    """The default self-check of MXFP4 experts + MXFP8 attention runs on the engines that load both (the newest
    vLLM), not on every engine of the main scheme: SGLang has no Quark MXFP8 scheme, so checking it there refused
    every such export (the engine rules schemes)."""
    quantize_checkpoint(toy, tmp_path / "out", recipe="experts-mxfp4-rest-mxfp8", log=lambda m: None)
    assert (tmp_path / "out" / "config.json").exists()
    with pytest.raises(QuantError, match="self-check failed"):
        quantize_checkpoint(toy, tmp_path / "sglang", recipe="experts-mxfp4-rest-mxfp8", log=lambda m: None,
                            check_engines=["sglang==latest"])
