"""Real release layouts in the quantizer and the preflight: Qwen3.5 as released (VL wrapper names, the whole-MTP
rule of SGLang), missing and malformed experts. Shapes from config.json: tests/test_verify_shapes.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quant.checkpoint import open_checkpoint
from quant.pipeline import quantize_checkpoint
from quant.toy import build_toy
from quant.verify import verify_checkpoint

pytestmark = pytest.mark.xdist_group("toy")
EXPERT = "model.layers.1.mlp.experts.2.down_proj"


def errors(report, engine=None):
    return [f for f in report.errors if engine is None or f.engine == engine]


def rewrite(path: Path, edit) -> None:
    """Apply `edit(tensors)` to the single shard of a checkpoint."""
    shard = next(path.glob("*.safetensors"))
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def mxfp4_export(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("layouts")
    quantize_checkpoint(build_toy("qwen3-moe", root / "src"), root / "q", log=lambda m: None)
    return root / "q"


def test_qwen35_release_layout_quantizes_and_names_engine_modules(toy_factory, tmp_path):
    out = tmp_path / "q"
    quantize_checkpoint(toy_factory("qwen3.5"), out, log=lambda m: None)
    config = json.loads((out / "config.json").read_text())
    exclude = config["quantization_config"]["exclude"]
    tensors = open_checkpoint(out).tensors
    # Vision tower and the whole MTP head stay BF16; routed experts of the language model are MXFP4.
    assert all(t.dtype != "U8" for n, t in tensors.items() if n.startswith(("mtp.", "model.visual.")))
    assert tensors["model.language_model.layers.0.mlp.experts.0.gate_proj.weight"].dtype == "U8"
    # Every BF16 linear is listed in checkpoint form and in the runtime form vLLM/SGLang build
    # (language_model.model.*, visual.*: qwen3_vl hf_to_vllm_mapper; SGLang builds the checkpoint names).
    for name in ("model.language_model.layers.1.self_attn.q_proj", "model.visual.blocks.0.attn.qkv"):
        assert name in exclude
    assert "language_model.model.layers.1.self_attn.q_proj" in exclude and "visual.blocks.0.attn.qkv" in exclude
    assert "mtp.fc" in exclude and "mtp.layers.0.mlp.experts.0.gate_proj" in exclude
    report = verify_checkpoint(out, engines=["sglang", "vllm==0.32"])
    assert not report.errors, [f.message for f in report.errors]


def test_qwen35_exclude_in_checkpoint_form_only_loads_on_every_release(toy_factory, tmp_path):
    """vLLM rewrites exclude with its hf_to_vllm_mapper; SGLang's Qwen3.5 classes have no mapper and build the
    checkpoint's names (the engine rules sglang name_mappers; tests/test_sglang_qwen35_names.py)."""
    out = tmp_path / "q"
    quantize_checkpoint(toy_factory("qwen3.5"), out, log=lambda m: None)
    config = json.loads((out / "config.json").read_text())
    q = config["quantization_config"]
    q["exclude"] = [e for e in q["exclude"] if not e.startswith(("language_model.", "visual."))]
    (out / "config.json").write_text(json.dumps(config))
    report = verify_checkpoint(out, engines=["sglang==0.5.12", "sglang==0.5.19", "vllm==0.32"])
    assert not report.errors, [f.message[:160] for f in report.errors]


def test_qwen35_partly_quantized_mtp_head_fails_sglang(toy_factory, tmp_path, monkeypatch):
    """Quantizing the MTP experts while mtp.fc stays BF16 (the family data without its whole-head keep rule):
    vLLM can build that, SGLang builds the whole draft unquantized as soon as any mtp.* entry is excluded, so
    the MXFP4 experts cannot load there."""
    import quant.pipeline.run as pipeline
    from quant.planning.recipes import load_family

    out = tmp_path / "q"
    family = load_family("qwen3_moe")
    family.roles["keep"] = [p for p in family.roles["keep"] if p.pattern != r"^mtp\."]
    monkeypatch.setattr(pipeline, "family_for_config", lambda config, path=None: family)
    quantize_checkpoint(toy_factory("qwen3.5"), out, check_engines=None, log=lambda m: None)
    assert open_checkpoint(out).tensors["mtp.layers.0.mlp.experts.0.gate_proj.weight"].dtype == "U8"
    report = verify_checkpoint(out, engines=["sglang==0.5.19", "vllm==0.32"])
    sglang = errors(report, "sglang")
    assert sglang and "builds the whole mtp.* draft unquantized" in sglang[0].message
    assert not errors(report, "vllm")


def test_a_deleted_expert_is_an_error(mxfp4_export, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(mxfp4_export, broken)
    rewrite(broken, lambda t: [t.pop(k) for k in list(t) if k.startswith("model.layers.1.mlp.experts.5.")])
    index = broken / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {k: v for k, v in data["weight_map"].items()
                              if not k.startswith("model.layers.1.mlp.experts.5.")}
        index.write_text(json.dumps(data))
    report = verify_checkpoint(broken, engines=["vllm==0.32"])
    assert any(f.tensor == "model.layers.1.mlp.experts.5.down_proj.weight" and "has 7 of the 8" in f.message
               for f in report.errors), [f.message for f in report.errors]


@pytest.mark.parametrize("shape", [(64,), (2, 160, 64), (0, 64)])
def test_an_expert_weight_that_is_not_2d_is_an_error(mxfp4_export, tmp_path, shape):
    broken = tmp_path / "broken"
    shutil.copytree(mxfp4_export, broken)
    rewrite(broken, lambda t: t.update({EXPERT + ".weight": torch.zeros(shape, dtype=torch.uint8)}))
    report = verify_checkpoint(broken, engines=["vllm==0.32"])
    assert any(f.tensor == EXPERT + ".weight" and "2-D weight" in f.message for f in report.errors), \
        [f.message for f in report.errors]
