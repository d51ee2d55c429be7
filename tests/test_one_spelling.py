"""tests_engines/cases.py one_spelling (issue #30): the exports the engine tiers derive so that `exclude` and
`layer_quant_config` name every module once, in one spelling. Checked here without an engine: each spelling lists
exactly the modules the export keeps BF16 / quantizes with another scheme, in that spelling only."""

from __future__ import annotations

import fnmatch
import json
import re

import pytest

from quant.pipeline import quantize_checkpoint
from tests_engines.cases import ONE_SPELLING, RECIPES, one_spelling

pytestmark = pytest.mark.xdist_group("toy")


@pytest.fixture(scope="module")
def qwen35(toy_factory, tmp_path_factory):
    out = tmp_path_factory.mktemp("spelling") / "q"
    quantize_checkpoint(toy_factory("qwen3.5"), out, recipe=str(RECIPES / "spelling-mix.yaml"), log=lambda m: None,
                        check_engines=None)
    return out


def _spelled(export, tmp_path, spelling):
    one_spelling(export, tmp_path / spelling, "qwen3.5", spelling)
    q = json.loads((tmp_path / spelling / "config.json").read_text())["quantization_config"]
    manifest = json.loads((export / "quant_manifest.json").read_text())
    fp8 = sorted(m for m, r in manifest["tensors"].items() if r.get("scheme") == "fp8")
    return q, manifest["kept_bf16"], fp8


@pytest.mark.parametrize("spelling", ONE_SPELLING["qwen3.5"])
def test_one_spelling_names_every_module_once(qwen35, tmp_path, spelling):
    q, kept, fp8 = _spelled(qwen35, tmp_path, spelling)
    exclude, keys = q["exclude"], list(q["layer_quant_config"])
    assert fp8 and kept and len(set(exclude)) == len(exclude)
    fp8_config = json.loads((qwen35 / "config.json").read_text())["quantization_config"]["layer_quant_config"]
    assert all(v == next(iter(fp8_config.values())) for v in q["layer_quant_config"].values())
    if spelling == "checkpoint":
        assert sorted(exclude) == sorted(kept) and sorted(keys) == fp8
    elif spelling == "text-only":
        assert not any(e.startswith(("model.language_model.", "language_model.", "model.visual.")) for e in exclude)
        assert "model.layers.0.linear_attn.out_proj" in exclude and "mtp.fc" in exclude and "lm_head" in exclude
        assert sorted(keys) == sorted(k.replace("model.language_model.", "model.") for k in fp8)
    elif spelling == "vllm":
        assert not any(e.startswith(("model.language_model.", "model.visual.")) for e in exclude)
        assert "language_model.model.layers.0.linear_attn.out_proj" in exclude and "visual.merger.linear_fc1" in \
            exclude and "language_model.lm_head" in exclude
    else:  # re: every kept module matched by a pattern (re.match, as the engines), no quantized module matched
        assert all(e.startswith("re:") for e in exclude)
        patterns = [re.compile(e[3:]) for e in exclude]
        assert all(any(p.match(m) for p in patterns) for m in kept)
        quantized = json.loads((qwen35 / "quant_manifest.json").read_text())["tensors"]
        assert not [m for m, r in quantized.items() if r.get("scheme") and any(p.match(m) for p in patterns)]
        assert all(any(fnmatch.fnmatchcase(m, k) for k in keys) for m in fp8) and all("*" in k for k in keys)


# vLLM (quark.py:133-161 apply_vllm_mapper: apply_dict) and SGLang 0.5.23 (quark.py:413-424) rewrite
# layer_quant_config keys with the class's name mapper; SGLang 0.5.12 rewrites only exclude (quark.py:73-74).
# Run in the tiers: the checkpoint-form export loads in vLLM 0.32 with its FP8 attention (test_vllm.py).
@pytest.mark.parametrize("engine,errors", [("vllm==0.32", False), ("sglang==0.5.23", False)])
def test_layer_quant_config_keys_in_checkpoint_form_are_mapped_where_the_engine_maps_them(qwen35, tmp_path, engine,
                                                                                         errors):
    from quant.verify import verify_checkpoint

    one_spelling(qwen35, tmp_path / "checkpoint", "qwen3.5", "checkpoint")
    report = verify_checkpoint(tmp_path / "checkpoint", engines=[engine])
    assert bool(report.errors) == errors, [f.message for f in report.errors][:3]
