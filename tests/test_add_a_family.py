"""Adding a model family is two data files (README, "Model families"): its record in manifests/families/ and its
toy beside it in manifests/toys/. Here a family the project does not ship (Qwen2-MoE: q/k/v bias, routed experts
and a gated shared expert; transformers' Qwen2MoeConfig) is added that way to a copy of the manifests
(QUANT_MANIFESTS_DIR) and used end to end by the real command line: its toy is built, quantized and preflighted,
with the family's roles deciding what is quantized."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data" / "new_family"


def quant(env: dict, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quant", *map(str, args)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_family_added_as_two_data_files_is_built_quantized_and_preflighted(tmp_path):
    from quant.paths import MANIFESTS_DIR

    manifests = tmp_path / "manifests"
    shutil.copytree(MANIFESTS_DIR, manifests)
    env = {**os.environ, "QUANT_MANIFESTS_DIR": str(manifests), "QUANT_CACHE_DIR": str(tmp_path / "cache")}
    missing = quant(env, "toy", "qwen2-moe", tmp_path / "before")
    assert missing.returncode == 2 and "unknown toy 'qwen2-moe'" in missing.stderr, missing.stderr

    shutil.copy(DATA / "family.yaml", manifests / "families" / "qwen2_moe.yaml")
    shutil.copy(DATA / "toys.yaml", manifests / "toys" / "qwen2_moe.yaml")
    built = quant(env, "toy", "qwen2-moe", tmp_path / "toy")
    assert built.returncode == 0, built.stderr
    config = json.loads((tmp_path / "toy" / "config.json").read_text())
    assert config["model_type"] == "qwen2_moe" and config["architectures"] == ["Qwen2MoeForCausalLM"]

    out = quant(env, "quantize", tmp_path / "toy", tmp_path / "out", "--no-progress")
    assert out.returncode == 0, out.stderr
    manifest = json.loads((tmp_path / "out" / "quant_manifest.json").read_text())
    records = manifest["tensors"]  # a quantized module under its name, a copied tensor under its own

    def action(module: str) -> str:
        return (records.get(module) or records[module + ".weight"])["action"]

    assert action("model.layers.1.mlp.experts.3.down_proj") == "quantize"
    assert action("model.layers.1.mlp.shared_expert.up_proj") == "quantize"
    assert records["model.layers.0.self_attn.q_proj.weight"]["role"] == "attention"  # BF16 in the default recipe
    assert action("model.layers.1.mlp.shared_expert_gate") == "copy"  # the generic record's keep
    assert action("model.layers.1.mlp.gate") == "copy"  # the router
    exclude = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["exclude"]
    assert "model.layers.1.mlp.shared_expert_gate" in exclude and "lm_head" in exclude

    check = quant(env, "verify-manifest", tmp_path / "out", "--json")
    assert check.returncode == 0, check.stdout + check.stderr
    assert json.loads(check.stdout)["errors"] == 0
