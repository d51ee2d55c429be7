"""Stray tensors (issue #42 item 3): a tensor its module, as an engine builds it, has no parameter for (an
input_scale beside a BF16 weight, a leaked weight_scale_inv / weight_scale_2 beside an MXFP4 one). Whether the
loader drops or rejects it is each release's load_weights (the engine rules stray_tensors, run by
tests_engines/test_stray_tensors.py): a dropped one is a warning, a rejected one an error quoting the engine."""

from __future__ import annotations

import pytest

from quant.verify import verify_checkpoint
from synthetic import glm_moe_dsa_config, glm_moe_dsa_layout, quark_layout, write_checkpoint

F32 = ("F32", ())
O_PROJ = "model.layers.0.self_attn.o_proj"           # kept BF16 by the portable recipe
EXPERT = "model.layers.1.mlp.experts.0.down_proj"    # MXFP4, dynamic activations
GATE = "model.layers.0.mlp.gate_proj"                # a dense MLP's stacked shard, BF16
Q_A = "model.layers.0.self_attn.q_a_proj"


def checkpoint(tmp_path, architecture: str, extra: dict):
    config = glm_moe_dsa_config(3)
    tensors, config = quark_layout(config, glm_moe_dsa_layout(config))
    assert f"{O_PROJ}.weight" in tensors and f"{EXPERT}.weight_scale" in tensors and f"{GATE}.weight" in tensors
    config["architectures"] = [architecture]  # the stray rules are per model class
    return write_checkpoint(tmp_path / "ckpt", config, {**tensors, **extra})


def findings(path, engine: str, tensor: str):
    report = verify_checkpoint(path, engines=[engine])
    return [(f.severity, f.message) for f in report.findings if f.tensor == tensor]


@pytest.mark.parametrize("engine,architecture,tensor,severity,text", [
    # SGLang's Qwen3-MoE load_weights skips any name not in params_dict (run: every kind loads)
    ("sglang==0.5.23", "Qwen3MoeForCausalLM", f"{O_PROJ}.input_scale", "warning", "ignored by the loader"),
    ("sglang==0.5.12", "Qwen3MoeForCausalLM", f"{EXPERT}.weight_scale_2", "warning", "ignored by the loader"),
    # vLLM's Qwen3-MoE ignores unexpected .input_scale / .weight_scale on a plain linear ...
    ("vllm==0.32", "Qwen3MoeForCausalLM", f"{O_PROJ}.input_scale", "warning", "ignored by the loader"),
    # ... but not weight_scale_inv, nor anything on an expert
    ("vllm==0.32", "Qwen3MoeForCausalLM", f"{O_PROJ}.weight_scale_inv", "error", "There is no module or parameter"),
    ("vllm==0.31", "Qwen3MoeForCausalLM", f"{EXPERT}.input_scale", "error", "Layer {layer} has no parameter"),
    ("vllm==0.33", "Qwen3MoeForCausalLM", f"{EXPERT}.weight_scale_2", "error", "Layer {layer} has no parameter"),
    # vLLM's DeepSeek loader indexes params_dict unguarded: every stray raises KeyError
    ("vllm==0.32", "DeepseekV3ForCausalLM", f"{O_PROJ}.input_scale", "error", "KeyError"),
    # SGLang's DeepSeek loader skips it, except on a stacked gate_up_proj shard
    ("sglang==0.5.23", "DeepseekV3ForCausalLM", f"{O_PROJ}.input_scale", "warning", "ignored by the loader"),
    ("sglang==0.5.19", "DeepseekV3ForCausalLM", f"{EXPERT}.weight_scale_inv", "warning", "ignored by the loader"),
    ("sglang==0.5.23", "DeepseekV3ForCausalLM", f"{GATE}.input_scale", "error", "KeyError"),
    # ... and, before 0.5.23, on the q_a_proj / kv_a_proj_with_mqa pair it fuses
    ("sglang==0.5.12", "DeepseekV3ForCausalLM", f"{Q_A}.input_scale", "error", "KeyError: '<layer>.self_attn.fused_qkv_a_proj_with_mqa"),
    ("sglang==0.5.23", "DeepseekV3ForCausalLM", f"{Q_A}.input_scale", "warning", "ignored by the loader"),
    # issue #49: lm_head.* is loaded by the top-level class, whose AutoWeightsLoader has no ignore list (vllm#44081)
    ("vllm==0.32", "Qwen3MoeForCausalLM", "lm_head.input_scale", "error", "named {name!r} in Qwen3MoeForCausalLM"),
    ("vllm==0.32", "DeepseekV3ForCausalLM", "lm_head.input_scale", "error", "in DeepseekV3ForCausalLM"),
    ("sglang==0.5.23", "Qwen3MoeForCausalLM", "lm_head.input_scale", "warning", "ignored by the loader"),
    # ... and a leaked exporter buffer outside every skip list
    ("vllm==0.32", "Qwen3MoeForCausalLM", f"{O_PROJ}.weight_double_scale", "error", "in Qwen3MoeModel"),
    ("vllm==0.32", "DeepseekV3ForCausalLM", f"{O_PROJ}.weight_double_scale", "error", "KeyError"),
    ("sglang==0.5.23", "DeepseekV3ForCausalLM", f"{O_PROJ}.output_zero_point", "warning", "ignored by the loader"),
])
def test_a_stray_tensor_is_what_the_loader_makes_of_it(tmp_path, engine, architecture, tensor, severity, text):
    dtype = ("U8", (64, 1)) if tensor.endswith("weight_scale_inv") else F32
    found = findings(checkpoint(tmp_path, architecture, {tensor: dtype}), engine, tensor)
    assert len(found) == 1 and found[0][0] == severity and text in found[0][1], found


def test_a_leaked_second_scale_beside_mxfp4_is_found(tmp_path):
    """weight_scale_2 beside an MXFP4 weight was not checked at all before: vLLM's FusedMoE raises on it."""
    path = checkpoint(tmp_path, "DeepseekV3ForCausalLM", {f"{EXPERT}.weight_scale_2": F32})
    assert [s for s, _ in findings(path, "vllm==0.32", f"{EXPERT}.weight_scale_2")] == ["error"]
