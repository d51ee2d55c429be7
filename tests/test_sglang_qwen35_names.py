"""SGLang builds Qwen3.5's language model under the checkpoint's own names (issue #30, part 1).

Qwen3_5MoeForConditionalGeneration / Qwen3_5ForConditionalGeneration set `hf_to_sglang_mapper = None` over the
Qwen3-VL mapper they inherit (sglang 0.5.23 models/qwen3_5.py:2376 and :2590; 0.5.12 :1443 and :1597), and
Qwen3VLForConditionalGeneration builds the text model with prefix "model.language_model" (qwen3_vl.py:1357-1361 in
0.5.23, :1124-1128 in 0.5.12), so the quant config sees model.language_model.* and `exclude` is matched as written.
An export whose exclude keeps the checkpoint form but not vLLM's language_model.model.* spelling loads in both
releases (run: the SGLang tier probe, tests_engines/test_sglang.py's one-spelling cases); the preflight used to
give SGLang the Qwen3-VL mapper and predict 7 load errors per release ("SGLang builds
language_model.model.layers.0.linear_attn.out_proj as MXFP4 ...")."""

from __future__ import annotations

import json
import shutil

import pytest

from quant import engines
from quant.pipeline import quantize_checkpoint
from quant.verify import verify_checkpoint

pytestmark = pytest.mark.xdist_group("toy")


@pytest.fixture(scope="module")
def qwen35_export(toy_factory, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen35-names") / "q"
    quantize_checkpoint(toy_factory("qwen3.5"), out, log=lambda m: None)
    return out


def _keep_only(export, tmp_path, keep):
    out = tmp_path / "e"
    shutil.copytree(export, out)
    config = json.loads((out / "config.json").read_text())
    q = config["quantization_config"]
    q["exclude"] = [e for e in q["exclude"] if keep(e)]
    (out / "config.json").write_text(json.dumps(config))
    return out


def sglang_errors(path, spec):
    return [f for f in verify_checkpoint(path, engines=[spec]).errors if f.engine == "sglang"]


@pytest.mark.parametrize("spec", ["sglang==0.5.12", "sglang==0.5.19", "sglang==0.5.23", "sglang"])
def test_exclude_without_language_model_model_entries_loads_on_sglang(qwen35_export, tmp_path, spec):
    """The issue's export: checkpoint-form (model.language_model.*) and text-only (model.*) entries kept, vLLM's
    runtime form (language_model.model.*) dropped."""
    path = _keep_only(qwen35_export, tmp_path, lambda e: not e.startswith("language_model."))
    errors = sglang_errors(path, spec)
    assert not errors, [f.message[:160] for f in errors]


@pytest.mark.parametrize("spec", ["sglang==0.5.12", "sglang==0.5.23"])
def test_checkpoint_form_only_loads_on_sglang(qwen35_export, tmp_path, spec):
    path = _keep_only(qwen35_export, tmp_path,
                      lambda e: e.startswith(("model.language_model.", "model.visual.", "mtp.")) or e == "lm_head")
    assert not sglang_errors(path, spec)


def test_sglang_names_the_checkpoint_module():
    """A finding names the module SGLang builds: model.language_model.*, not Qwen3-VL's language_model.model.*."""
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"]}
    for release in engines.releases("sglang"):
        rules = engines.profile("sglang", release).rules
        assert engines.name_mapper(rules, config) == {}, release
    # vLLM keeps its mapper (qwen3_5.py hf_to_vllm_mapper from qwen3_vl.py), so the quantizer still writes that form.
    assert "language_model.model.layers.0.linear_attn.out_proj" in engines.exclude_aliases(
        "model.language_model.layers.0.linear_attn.out_proj", config)
