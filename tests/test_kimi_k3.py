"""Kimi-K3 (issue #31): the toy in the release's storage (compressed-tensors MXFP4 routed experts, written from the
toys.yaml layout: transformers has no kimi_k3 class), its Quark export (the experts carried over bit for bit), and
the SGLang 0.5.23 naming the preflight predicts with (the engine rules: the mapper, the language model built under
"model.", the config registry). SGLang itself runs in tests_engines/test_sglang.py -k kimi-k3."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from quant.pipeline import quantize_checkpoint
from quant.toy import build_toy
from quant.verify import verify_checkpoint

L = "language_model.model.layers."


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    root = tmp_path_factory.mktemp("k3")
    src = build_toy("kimi-k3", root / "src")
    out = root / "out"
    quantize_checkpoint(src, out, check_engines=None, log=lambda m: None)
    return src, out


def test_the_toy_is_the_release_layout(k3):
    src, _ = k3
    config = json.loads((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    assert config["architectures"] == ["KimiK3ForConditionalGeneration"] and config["model_type"] == "kimi_k3"
    q = config["quantization_config"]
    assert q["format"] == "mxfp4-pack-quantized" and q["quant_method"] == "compressed-tensors"
    assert "re:.*self_attn\\..*" in q["ignore"] and "lm_head" in q["ignore"]
    expert = L + "1.block_sparse_moe.experts.7.w2."
    assert tensors[expert + "weight_packed"].dtype == torch.uint8 and tensors[expert + "weight_packed"].shape == (96, 64)
    assert tensors[expert + "weight_scale"].dtype == torch.uint8 and tensors[expert + "weight_scale"].shape == (96, 4)
    assert not any(n.endswith(".weight_packed") and ".experts." not in n for n in tensors)  # experts only
    a_log = tensors[L + "0.self_attn.A_log"]  # padded to head_dim, the first num_heads set
    assert a_log.dtype == torch.float32 and a_log.shape == (64,) and bool((a_log[2:] == 0).all()) and bool(a_log[:2].all())
    kinds = {i: {n.split(".")[5] for n in tensors if n.startswith(f"{L}{i}.self_attn.")} for i in range(3)}
    assert "q_conv1d" in kinds[0] and "kv_b_proj" in kinds[1] and "b_proj" in kinds[2]  # KDA, MLA, KDA
    assert L + "0.mlp.gate_proj.weight" in tensors and L + "0.block_sparse_moe.gate.weight" not in tensors
    assert tensors[L + "1.block_sparse_moe.gate.e_score_correction_bias"].dtype == torch.float32


def test_the_export_carries_the_experts_over_bit_for_bit(k3):
    src, out = k3
    source, export = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    manifest = json.loads((out / "quant_manifest.json").read_text())["tensors"]
    experts = {n: r for n, r in manifest.items() if r.get("role") == "routed_experts"}
    assert len(experts) == 2 * 8 * 3 and {r["action"] for r in experts.values()} == {"passthrough"}
    for e in range(8):
        base = f"{L}2.block_sparse_moe.experts.{e}.w1."
        assert torch.equal(export[base + "weight"], source[base + "weight_packed"])
        assert torch.equal(export[base + "weight_scale"], source[base + "weight_scale"])


def _edited(out, tmp_path, name, keep):
    path = tmp_path / name
    shutil.copytree(out, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["exclude"] = [e for e in config["quantization_config"]["exclude"] if keep(e)]
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_sglang_0523_is_predicted_to_load_it_under_its_own_names(k3, tmp_path):
    _, out = k3
    assert verify_checkpoint(out, engines=["sglang==0.5.23"]).errors == []
    exclude = json.loads((out / "config.json").read_text())["quantization_config"]["exclude"]
    # SGLang 0.5.23 builds the language model under "model." (the engine rules build_prefixes); the export names both
    assert "model.layers.1.self_attn.kv_b_proj" in exclude and "language_model.model.layers.1.self_attn.kv_b_proj" in exclude
    # ... and its QuarkConfig strips "language_model." from mapped entries itself (exclude_prefix_aliases): the
    # checkpoint names alone load too (run in SGLang 0.5.23: loaded, attention BF16)
    names_only = _edited(out, tmp_path, "checkpoint-names-only", lambda e: not e.startswith("model."))
    assert verify_checkpoint(names_only, engines=["sglang==0.5.23"]).errors == []
    # without the attention entries SGLang builds MXFP4 attention and fails on the BF16 weights (run: AssertionError
    # target.shape=torch.Size([2, 80]), loaded_weight.shape=torch.Size([2, 160]) on a KDA b_proj)
    no_attention = _edited(out, tmp_path, "attention-exclude-dropped", lambda e: ".self_attn." not in e)
    errors = verify_checkpoint(no_attention, engines=["sglang==0.5.23"]).errors
    assert any(f.tensor and ".self_attn.b_proj" in f.tensor for f in errors), [f.message for f in errors]


def test_releases_without_a_kimi_k3_config_class_cannot_read_it(k3):
    _, out = k3
    # SGLang 0.5.12's wheel has no KimiK3Config (0.5.19 has: srt/utils/hf_transformers/common.py _CONFIG_REGISTRY),
    # and no transformers knows kimi_k3; vLLM registers it from 0.31 on (scripts/release_parsing.py over the wheels).
    errors = verify_checkpoint(out, engines=["sglang==0.5.12"]).errors
    assert [f.rule for f in errors] == ["engine config registry"]
    for release in ("sglang==0.5.19", "sglang==0.5.23", "vllm==0.31", "vllm==0.32"):
        assert not [f for f in verify_checkpoint(out, engines=[release]).errors
                    if f.rule == "engine config registry"], release
