"""The preflight on MXFP8 (issue #31 item 5): which engine releases build a Quark MXFP8 [1, 32] layer (fp8_e4m3
per_group 32 e8m0 weights, dynamic MXFP8 activations) and what they expect on disk (the engine rules `schemes`,
quant/verify/contract.py). vLLM 0.31 to 0.33 build MXFP8 linears (QuarkOCP_MX); only 0.33 builds MXFP8 experts
(QuarkW8A8Mxfp8MoEMethod; 0.31/0.32 raise "MXFP8 experts are not supported through the MoE path"); SGLang 0.5.12 and
0.5.23 have no Quark MXFP8 scheme at all."""

from __future__ import annotations

import copy
import json
import re

import pytest

from quant.verify import verify_checkpoint
from quant.verify.schema import classify
from synthetic import (MXFP8_SPEC, glm_moe_dsa_config, glm_moe_dsa_layout, layer_config,
                                    quantized_tensors, quark_layout, write_checkpoint)

# DeepSeek-V4.1-Flash-MXFP4's attention spec (vllm#57191): MXFP8 with one E8M0 scale per 32 x 32 block.
BLOCK_SPEC = dict(MXFP8_SPEC, qscheme="per_block", group_size=None, block_size=[32, 32], symmetric=True,
                  scale_type="float8_e8m0fnu")
RELEASES = ["vllm==0.31", "vllm==0.32", "vllm==0.33", "sglang==0.5.12", "sglang==0.5.23"]
EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")


def _unsupported(report) -> set[tuple[str, str, str]]:
    """(engine, release, 'linear' or 'moe') of every "unsupported scheme" error."""
    out = set()
    for f in report.errors:
        if "unsupported scheme" in f.rule:
            unit = "moe" if " on moe modules" in f.message else "linear"
            out |= {(f.engine, v, unit) for v in f.versions}
    return out


def _released(report, engine: str, release: str) -> list:
    return [f for f in report.errors if f.engine == engine and release in f.versions]


def _all_mxfp8():
    cfg = glm_moe_dsa_config()
    tensors, config = quark_layout(cfg, glm_moe_dsa_layout(cfg), scheme="w_mxfp8_a_mxfp8")
    return tensors, config


def _mixed():
    """AMD's mixed layout (recipe experts-mxfp4-rest-mxfp8): routed experts MXFP4 under global_quant_config, every
    other quantized linear MXFP8 through a layer_quant_config entry named after it."""
    cfg = glm_moe_dsa_config()
    bf16 = glm_moe_dsa_layout(cfg)
    tensors, config = quark_layout(cfg, bf16)
    lqc = config["quantization_config"]["layer_quant_config"]
    for name, (dtype, shape) in list(tensors.items()):
        module = name[: -len(".weight")]
        if dtype == "U8" and name.endswith(".weight") and not EXPERT.search(name):
            tensors.update(quantized_tensors(module, bf16[name][1], "w_mxfp8_a_mxfp8"))
            lqc[module] = layer_config("w_mxfp8_a_mxfp8")
    assert lqc and any(EXPERT.search(n) and d == "U8" for n, (d, _) in tensors.items())
    return tensors, config


def test_mxfp8_everywhere_loads_in_vllm_033_only(tmp_path):
    tensors, config = _all_mxfp8()
    ckpt = write_checkpoint(tmp_path / "ckpt", config, tensors)
    report = verify_checkpoint(ckpt, engines=RELEASES)
    assert _unsupported(report) == {("vllm", "0.31", "moe"), ("vllm", "0.32", "moe"),
                                    ("sglang", "0.5.12", "linear"), ("sglang", "0.5.12", "moe"),
                                    ("sglang", "0.5.23", "linear"), ("sglang", "0.5.23", "moe")}
    assert _released(report, "vllm", "0.33") == []
    vllm = next(f for f in report.errors if f.engine == "vllm" and "unsupported scheme" in f.rule)
    assert "MXFP8 experts are not supported through the MoE path" in vllm.message
    sglang = [f.message for f in report.errors if f.engine == "sglang" and "unsupported scheme" in f.rule]
    assert any("No quark compatible scheme was found" in m for m in sglang)
    assert any("Unsupported FusedMoe scheme" in m for m in sglang)


def test_mxfp4_experts_with_mxfp8_elsewhere_loads_in_every_vllm_release(tmp_path):
    tensors, config = _mixed()
    report = verify_checkpoint(write_checkpoint(tmp_path / "ckpt", config, tensors), engines=RELEASES)
    assert _unsupported(report) == {("sglang", "0.5.12", "linear"), ("sglang", "0.5.23", "linear")}
    assert [f for f in report.errors if f.engine == "vllm"] == []


def test_the_quantizer_s_mixed_export_agrees(tmp_path):
    """A real export (recipe experts-mxfp4-rest-mxfp8 on the qwen3-moe toy) through the same preflight."""
    from quant.pipeline import quantize_checkpoint
    from quant.toy import build_toy

    src = build_toy("qwen3-moe", tmp_path / "src", seed=0)
    out = tmp_path / "out"
    quantize_checkpoint(src, out, recipe="experts-mxfp4-rest-mxfp8", check_engines="", log=lambda m: None)
    report = verify_checkpoint(out, engines=RELEASES)
    assert [f for f in report.errors if f.engine == "vllm"] == []
    assert _unsupported(report) == {("sglang", "0.5.12", "linear"), ("sglang", "0.5.23", "linear")}


def test_mxfp8_tensor_contract(tmp_path):
    tensors, config = _all_mxfp8()
    q_a = "model.layers.1.self_attn.q_a_proj"
    out_f, in_f = tensors[q_a + ".weight"][1]
    tensors[q_a + ".weight_scale"] = ("F32", (out_f,))  # per-channel FP8's scale under an MXFP8 config
    tensors["model.layers.2.self_attn.o_proj.input_scale"] = ("F32", ())  # dynamic activations: no input scale
    report = verify_checkpoint(write_checkpoint(tmp_path / "ckpt", config, tensors), engines=["vllm==0.33"])
    bad = {f.tensor: f.message for f in report.errors if f.rule == "tensor contract"}
    assert set(bad) == {q_a + ".weight_scale", "model.layers.2.self_attn.o_proj.input_scale"}
    assert f"expected U8 [{out_f}, {in_f // 32}] (E8M0, one byte per 32 inputs)" in bad[q_a + ".weight_scale"]
    tensors, config = _all_mxfp8()
    tp = verify_checkpoint(write_checkpoint(tmp_path / "ok", config, tensors), engines=["vllm==0.33"], tp=4)
    split = [f for f in tp.errors if "(TP)" in f.rule]
    assert split and all(f.tensor.endswith((".o_proj.weight", ".down_proj.weight")) for f in split)


def test_a_weight_stored_as_mxfp4_under_an_mxfp8_config(tmp_path):
    tensors, config = _mixed()
    lqc = config["quantization_config"]["layer_quant_config"]
    module = "model.layers.1.self_attn.o_proj"
    tensors.update(quantized_tensors(module, glm_moe_dsa_layout(glm_moe_dsa_config())[module + ".weight"][1],
                                     "w_mxfp4_a_mxfp4"))
    assert module in lqc
    report = verify_checkpoint(write_checkpoint(tmp_path / "ckpt", config, tensors), engines=["vllm==0.32"])
    hit = [f for f in report.errors if f.tensor == module + ".weight"]
    assert hit and "as MXFP8" in hit[0].message and "F8_E4M3" in hit[0].message


@pytest.mark.parametrize("change, kind", [
    ({}, "mxfp8"),
    ({"input_tensors": None}, "unmodelled"),                                   # weight-only: another path
    ({"input_tensors": dict(MXFP8_SPEC, is_dynamic=False)}, "unmodelled"),     # static MX activations
    ({"input_tensors": dict(MXFP8_SPEC, qscheme="per_tensor", group_size=None, is_dynamic=True)}, "unmodelled"),
    ({"weight": BLOCK_SPEC}, "mxfp8_block"),                                   # DeepSeek-V4.1's 2-D spelling
    ({"weight": dict(BLOCK_SPEC, symmetric=None)}, "unmodelled"),              # vLLM wants it symmetric
    ({"weight": dict(BLOCK_SPEC, scale_type="float")}, "other"),               # not E8M0: block FP8, not MXFP8
    ({"weight": dict(MXFP8_SPEC, group_size=64)}, "other"),
])
def test_mxfp8_spellings(change, kind):
    cfg = copy.deepcopy(layer_config("w_mxfp8_a_mxfp8"))
    cfg.update(copy.deepcopy(change))
    assert classify(cfg) == kind, json.dumps(cfg)


# ---- vllm#57071/#57191: per-layer MXFP8 specs in [32, 32] blocks (amd/DeepSeek-V4.1-Flash-MXFP4) ---------------

def _mixed_blocks(scale_rows=lambda out_f: out_f // 32, scale_dtype="F8_E8M0"):
    """MXFP4 experts, every other quantized linear MXFP8 in [32, 32] blocks (weight F8_E4M3 [out, in], scale
    [out/32, in/32]), each through its own layer_quant_config entry."""
    cfg = glm_moe_dsa_config()
    bf16 = glm_moe_dsa_layout(cfg)
    tensors, config = quark_layout(cfg, bf16)
    lqc = config["quantization_config"]["layer_quant_config"]
    spec = dict(layer_config("w_mxfp8_a_mxfp8"), weight=dict(BLOCK_SPEC))
    for name, (dtype, _) in list(tensors.items()):
        if dtype == "U8" and name.endswith(".weight") and not EXPERT.search(name):
            module, (out_f, in_f) = name[: -len(".weight")], bf16[name][1]
            tensors[name] = ("F8_E4M3", (out_f, in_f))
            tensors[module + ".weight_scale"] = (scale_dtype, (scale_rows(out_f), in_f // 32))
            lqc[module] = spec
    return tensors, config


def test_mxfp8_in_32x32_blocks_loads_in_every_vllm_release(tmp_path):
    tensors, config = _mixed_blocks()
    report = verify_checkpoint(write_checkpoint(tmp_path / "ckpt", config, tensors), engines=RELEASES)
    assert [f for f in report.errors if f.engine == "vllm"] == []
    assert not [f for f in report.warnings if "not modelled" in f.message]
    assert _unsupported(report) == {("sglang", "0.5.12", "linear"), ("sglang", "0.5.23", "linear")}
    sglang = next(f for f in report.errors if f.engine == "sglang" and "0.5.23" in f.versions)
    assert "weight_scale_inv" in sglang.message
    u8 = verify_checkpoint(write_checkpoint(tmp_path / "u8", *reversed(_mixed_blocks(scale_dtype="U8"))),
                           engines=["vllm==0.32"])
    assert u8.errors == []  # the loader reads the scale as bytes: U8 or F8_E8M0


def test_mxfp8_block_scale_contract(tmp_path):
    tensors, config = _mixed_blocks(scale_rows=lambda out_f: out_f)  # one scale row per weight row: 1-D
    report = verify_checkpoint(write_checkpoint(tmp_path / "ckpt", config, tensors), engines=["vllm==0.33"])
    bad = [f for f in report.errors if f.rule == "tensor contract"]
    assert bad and all(f.tensor.endswith(".weight_scale") for f in bad)
    assert "(E8M0, one byte per 32 x 32 block)" in bad[0].message


def test_mxfp8_block_experts(tmp_path):
    cfg = glm_moe_dsa_config()
    tensors, config = quark_layout(cfg, glm_moe_dsa_layout(cfg), scheme="w_mxfp8_a_mxfp8")
    config["quantization_config"]["global_quant_config"]["weight"] = dict(BLOCK_SPEC)
    for name, (dtype, shape) in list(tensors.items()):
        if name.endswith(".weight_scale"):
            tensors[name] = ("F8_E8M0", (shape[0] // 32, shape[1]))
    report = verify_checkpoint(write_checkpoint(tmp_path / "ckpt", config, tensors), engines=["vllm==0.33"])
    moe = [f for f in report.errors if "unsupported scheme" in f.rule]
    assert len(moe) == 1 and "only the 1-D per_group" in moe[0].message and " on moe modules" in moe[0].message


def test_transformers_with_amd_quark_cannot_run_mxfp8(tmp_path):
    """amd-quark 0.13 (the transformers 5.23 runtime) loads an MXFP8 [1, 32] linear and raises on its first forward
    (the engine rules: run on the qwen3-moe toy with MXFP8 attention)."""
    tensors, config = _mixed()
    report = verify_checkpoint(write_checkpoint(tmp_path / "ckpt", config, tensors), engines=["transformers"])
    hit = [f for f in report.errors if "unsupported scheme" in f.rule]
    assert hit and "Unsupported QuantSchema: per_group for quant_dtype: fp8_e4m3" in hit[0].message
