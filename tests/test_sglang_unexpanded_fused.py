"""SGLang's Glm4MoeForCausalLM (GLM-4.5 to 4.7) builds a fused qkv_proj, but its quant config has no packed mapping
for it, so `exclude` must name `<layer>.self_attn.qkv_proj` itself (the engine rules `unexpanded_fused`, observed in
tests_engines/test_sglang.py on the glm4.7 toy with SGLang 0.5.12 and 0.5.23). The quantizer writes the fused name
for the main layers and the NextN draft; without it the preflight predicts the failure SGLang shows."""

from __future__ import annotations

import json

import pytest

from quant.pipeline import quantize_checkpoint
from quant.toy import build_toy
from quant.verify import verify_checkpoint

pytestmark = pytest.mark.xdist_group("toy")


@pytest.fixture(scope="module")
def glm47_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm47")
    build_toy("glm4.7", root / "toy")
    quantize_checkpoint(root / "toy", root / "q", recipe="experts-only", check_engines=None, log=lambda m: None)
    return root / "q"


def _sglang_errors(path, release):
    report = verify_checkpoint(path, engines=[f"sglang=={release}"])
    return [f for f in report.errors if f.engine in ("sglang", "all")]


def test_export_names_the_fused_qkv_proj(glm47_export):
    exclude = json.loads((glm47_export / "config.json").read_text())["quantization_config"]["exclude"]
    for layer in (0, 1, 2):
        assert f"model.layers.{layer}.self_attn.q_proj" in exclude
        assert f"model.layers.{layer}.self_attn.qkv_proj" in exclude
    assert "model.decoder.self_attn.qkv_proj" in exclude  # the NextN draft (Glm4MoeForCausalLMNextN)
    for release in ("0.5.12", "0.5.23"):
        assert not _sglang_errors(glm47_export, release)


@pytest.mark.parametrize("release", ["0.5.12", "0.5.23"])
def test_shard_entries_alone_do_not_exclude_it(glm47_export, tmp_path, release):
    import shutil

    out = tmp_path / "damaged"
    shutil.copytree(glm47_export, out)
    config = json.loads((out / "config.json").read_text())
    q = config["quantization_config"]
    q["exclude"] = [e for e in q["exclude"] if not e.endswith(".qkv_proj")]
    (out / "config.json").write_text(json.dumps(config))
    errors = _sglang_errors(out, release)
    built = {f.tensor for f in errors}
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.2.self_attn.q_proj.weight"} <= built
    assert any("model.decoder.self_attn.qkv_proj" in f.message for f in errors)
    assert all("qkv_proj" in f.fix for f in errors)
    # vLLM expands qkv_proj into its shards: the same checkpoint loads there
    assert not [f for f in verify_checkpoint(out, engines=["vllm==0.32"]).errors if f.engine in ("vllm", "all")]
