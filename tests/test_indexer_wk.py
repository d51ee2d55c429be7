"""The DSA indexer's wk under vLLM: fused with weights_proj into one unquantized GEMM, an E4M3 wk upcast on load, any
other stored format loaded as it is (the engine rules vllm never_quantized / loader_dequantizes). Found by the vLLM
tier: the glm5 all-linear MXFP4 export raised AssertionError in vLLM's load_merged_column_weight."""

from __future__ import annotations

import json

from safetensors.torch import load_file, save_file

from quant.numerics.mxfp4 import quantize_mxfp4
from quant.pipeline import quantize_checkpoint
from quant.verify import verify_checkpoint

WK = "model.layers.0.self_attn.indexer.wk"


def _vllm_errors(path):
    report = verify_checkpoint(path, engines=["vllm==0.32"])
    return [f for f in report.errors if f.engine in ("vllm", "all")]


def test_mxfp4_all_linear_keeps_wk_bf16_and_loads_in_vllm(toy_factory, tmp_path):
    out = tmp_path / "q"
    quantize_checkpoint(toy_factory("glm5"), out, recipe="all-linear", check_engines=None, log=lambda m: None)
    manifest = json.loads((out / "quant_manifest.json").read_text())
    assert manifest["tensors"][WK + ".weight"].get("scheme") in (None, "bf16"), manifest["tensors"][WK + ".weight"]
    assert manifest["tensors"]["model.layers.0.self_attn.indexer.wq_b"]["scheme"] == "w_mxfp4_a_mxfp4"
    assert _vllm_errors(out) == []


def test_fp8_wk_is_upcast_by_vllm(toy_factory, tmp_path):
    out = tmp_path / "q"
    quantize_checkpoint(toy_factory("glm5"), out, scheme="fp8-block", recipe="all-linear", check_engines=None,
                        log=lambda m: None)
    assert json.loads((out / "quant_manifest.json").read_text())["tensors"][WK]["scheme"] == "fp8-block"
    assert _vllm_errors(out) == []


def test_mxfp4_wk_is_a_vllm_load_error(toy_factory, tmp_path):
    out = tmp_path / "q"
    quantize_checkpoint(toy_factory("glm5"), out, recipe="all-linear", check_engines=None, log=lambda m: None)
    shard = next(out.glob("*.safetensors"))
    tensors = load_file(shard)
    codes, scales = quantize_mxfp4(tensors[WK + ".weight"].float(), "even", compiled=False)
    tensors[WK + ".weight"], tensors[WK + ".weight_scale"] = codes, scales
    save_file(tensors, shard, metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    q = config["quantization_config"]
    q["exclude"] = [e for e in q["exclude"] if not e.endswith(".indexer.wk")]
    (out / "config.json").write_text(json.dumps(config))
    errors = _vllm_errors(out)
    assert errors and any(WK in f.tensor for f in errors), errors
