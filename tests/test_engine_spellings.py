"""Engine rules found by the tiers' one-spelling exports (issue #30, tests_engines/cases.py one_spelling): exports
whose exclude names each module once, as other tools write them. Fast: the preflight only, no engine.

- SGLang 0.5.23 builds MiniMax-M3's MoE as layers.N.mlp and rewrites `exclude` with the class's
  orig_to_new_substr mapper {".block_sparse_moe.": ".mlp."} (minimax_m3_vl.py:69-71, minimax_m3.py:1728-1734):
  exact checkpoint-form entries match, `re:` entries on the checkpoint names are not rewritten and miss (run: the
  SGLang tier's minimax-m3 spelling-re case failed to load, spelling-checkpoint loaded).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from quant import engines
from quant.pipeline import quantize_checkpoint
from quant.verify import verify_checkpoint

pytestmark = pytest.mark.xdist_group("toy")
M3 = {"architectures": ["MiniMaxM3SparseForConditionalGeneration"]}


def test_substring_mapper_entries():
    mapper = {".block_sparse_moe.": ".mlp.", "model.language_model.": "language_model.model."}
    assert engines.runtime_name("language_model.model.layers.1.block_sparse_moe.gate", mapper) == \
        "language_model.model.layers.1.mlp.gate"
    assert engines.runtime_name("model.language_model.layers.1.block_sparse_moe.gate", mapper) == \
        "language_model.model.layers.1.mlp.gate"  # substring first, then the prefix, as WeightsMapper._map_name
    assert engines.runtime_name("lm_head", {"lm_head.": "language_model.lm_head."}) == "language_model.lm_head"
    assert engines.runtime_name("model.block_sparse_moe_x", mapper) == "model.block_sparse_moe_x"


def test_minimax_m3_sglang_runtime_names():
    rules = engines.profile("sglang", "0.5.23").rules
    mapper = engines.name_mapper(rules, M3)
    assert engines.runtime_name("language_model.model.layers.1.block_sparse_moe.shared_experts.down_proj",
                                mapper) == "language_model.model.layers.1.mlp.shared_experts.down_proj"
    assert rules.maps_exclude
    # No alias: 0.5.23 rewrites exclude itself, so the quantizer's entries stay as they were.
    assert engines.exclude_aliases("language_model.model.layers.1.block_sparse_moe.shared_experts.down_proj", M3) == \
        ["language_model.model.layers.1.block_sparse_moe.shared_experts.down_proj"]


RECIPE = Path(__file__).resolve().parents[1] / "tests_engines" / "recipes" / "spelling-mix.yaml"


@pytest.fixture(scope="module")
def m3_export(toy_factory, tmp_path_factory):
    """MiniMax-M3 with its shared experts (block_sparse_moe.shared_experts.*) BF16 and listed in exclude."""
    out = tmp_path_factory.mktemp("m3-spelling") / "q"
    quantize_checkpoint(toy_factory("minimax-m3"), out, recipe=str(RECIPE), log=lambda m: None, check_engines=None)
    return out


def _rewrite(export, out, edit):
    shutil.copytree(export, out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["exclude"] = edit(config["quantization_config"]["exclude"])
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_minimax_m3_regex_exclude_misses_on_sglang_0_5_23(m3_export, tmp_path):
    exclude = json.loads((m3_export / "config.json").read_text())["quantization_config"]["exclude"]
    assert any(".block_sparse_moe.shared_experts." in e for e in exclude)
    regex = _rewrite(m3_export, tmp_path / "re", lambda ex: ["re:" + re.escape(e) + "$" for e in ex])
    errors = verify_checkpoint(regex, engines=["sglang==0.5.23"]).errors
    assert errors, "re: entries on block_sparse_moe names are not rewritten by SGLang's substring mapper"
    assert all(".block_sparse_moe." in f.tensor for f in errors), [f.tensor for f in errors]
    exact = _rewrite(m3_export, tmp_path / "exact", lambda ex: [e for e in ex if not e.startswith("re:")])
    assert not verify_checkpoint(exact, engines=["sglang==0.5.23"]).errors


def test_transformers_never_builds_the_qwen35_vision_tower(toy_factory, tmp_path):
    """AutoModelForCausalLM builds Qwen3.5's text model alone and drops model.visual.* (transformers 5.23
    modeling_qwen3_5_moe.py:1817): an exclude without vision entries (the text-only spelling) is no finding there
    (run: the transformers tier's qwen3.5 spelling-text-only export loads)."""
    export = tmp_path / "q"
    quantize_checkpoint(toy_factory("qwen3.5"), export, log=lambda m: None, check_engines=None)
    path = _rewrite(export, tmp_path / "text-only",
                    lambda ex: [e for e in ex if not e.startswith(("model.visual.", "visual."))])
    findings = verify_checkpoint(path, engines=["transformers==5.23"]).errors
    assert not [f for f in findings if "visual" in f.tensor], [f.message[:160] for f in findings]


def test_one_name_mapper_for_model_and_draft_classes():
    """The draft classes' exclude mappers go through the same WeightsMapper as the model classes' name mappers:
    every key a substring, the longest found replaced once, "{N}" the MTP layer's index."""
    mapper = engines.NameMapper.substrings({"model.layers.{N}": "model.decoder",
                                            "model.layers.{N}.eh_proj": "model.eh_proj"}, 78)
    assert mapper("model.layers.78.eh_proj") == "model.eh_proj"
    assert mapper("model.layers.78.mlp.experts.0.w1") == "model.decoder.mlp.experts.0.w1"
    assert mapper("re:model.layers.78.*") == "re:model.decoder.*"
    assert mapper("model.layers.7.eh_proj") == "model.layers.7.eh_proj"
    assert engines.NameMapper.of({".block_sparse_moe.": ".mlp."}) == \
        engines.NameMapper(substr=((".block_sparse_moe.", ".mlp."),))
    assert not engines.NameMapper.of({})
