"""vLLM's names for the wrappers it registers without a CPU tier to build them (issue #42 item 2): GLM-5.3-Flash
(Glm5NextForConditionalGeneration), Qwen4-Exp (Qwen4ExpForConditionalGeneration) and Kimi-K3
(KimiK3ForConditionalGeneration), read from the vLLM 0.31.0, 0.32.0 and 0.33.0 wheels (the engine rules, vllm
name_mappers, cites the lines). vLLM builds each module under the name its class's hf_to_vllm_mapper gives the
checkpoint's, and QuarkConfig.apply_vllm_mapper rewrites `exclude` and layer_quant_config keys with the same mapper
(its get_rename_mapper(): None entries dropped; quark/quark.py:133-161, models/utils.py:180-199 in the 0.32.0 wheel).

The expected names below are the wheels' WeightsMapper._map_name (models/utils.py:89-145: orig_to_new_prefix entries,
a matching prefix replaced once) applied by hand to the toys' tensor names, written out literally.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from quant.engines import profile
from quant.safetensors_header import read_header

pytestmark = pytest.mark.xdist_group("toy")

RELEASES = ("0.31", "0.32", "0.33")

# Qwen4ExpForConditionalGeneration inherits Qwen3_5ForConditionalGeneration.hf_to_vllm_mapper (qwen3_5.py:476-479 in
# the 0.32.0 wheel) = Qwen3VLForConditionalGeneration's orig_to_new_prefix {"model.visual.": "visual.", "lm_head.":
# "language_model.lm_head.", "model.language_model.": "language_model.model."} (qwen3_vl.py:1969-1975) | {"mtp.":
# None}, which get_rename_mapper drops: the quant config keeps mtp.* names as written.
QWEN4_EXP = {
    "model.language_model.layers.0.linear_attn.in_proj_qkv.weight":
        "language_model.model.layers.0.linear_attn.in_proj_qkv.weight",
    "model.language_model.layers.0.ple.key_proj.weight": "language_model.model.layers.0.ple.key_proj.weight",
    "model.language_model.layers.0.mlp.experts.0.down_proj.weight":
        "language_model.model.layers.0.mlp.experts.0.down_proj.weight",
    "model.language_model.layers.1.self_attn.indexer.index_qk_proj.weight":
        "language_model.model.layers.1.self_attn.indexer.index_qk_proj.weight",
    "model.visual.blocks.0.attn.qkv.weight": "visual.blocks.0.attn.qkv.weight",
    "model.visual.merger.linear_fc1.weight": "visual.merger.linear_fc1.weight",
    "lm_head.weight": "language_model.lm_head.weight",
    "mtp.layers.0.self_attn.q_proj.weight": "mtp.layers.0.self_attn.q_proj.weight",
}
# KimiK3ForConditionalGeneration.hf_to_vllm_mapper (kimi_k3/nvidia/model.py:1749-1755 in the 0.32.0 wheel):
# orig_to_new_prefix {"language_model.layers.": "language_model.model.layers.", "mm_projector.proj.0":
# "mm_projector.linear_1", "mm_projector.proj.2": "mm_projector.linear_2"}. The checkpoint's language_model.model.*
# names are vLLM's (the text model under maybe_prefix(prefix, "language_model"), :1843, its MoE under
# block_sparse_moe, :946); only the projector is renamed.
KIMI_K3 = {
    "mm_projector.proj.0.weight": "mm_projector.linear_1.weight",
    "mm_projector.proj.2.weight": "mm_projector.linear_2.weight",
    "language_model.model.layers.0.self_attn.q_proj.weight": "language_model.model.layers.0.self_attn.q_proj.weight",
    "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed":
        "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed",
    "language_model.lm_head.weight": "language_model.lm_head.weight",
    "vision_tower.encoder.blocks.0.wqkv.weight": "vision_tower.encoder.blocks.0.wqkv.weight",
}
# Glm5NextForConditionalGeneration inherits Glm4vForConditionalGeneration.hf_to_vllm_mapper (glm4_1v.py:1754-1760 in
# the 0.32.0 wheel): {"lm_head.": "language_model.lm_head.", "model.language_model.": "language_model.model.",
# "model.visual.": "visual."}.
GLM5_NEXT = {
    "model.language_model.layers.0.mlp.gate_proj.weight": "language_model.model.layers.0.mlp.gate_proj.weight",
    "model.language_model.layers.1.mlp.experts.0.up_proj.weight":
        "language_model.model.layers.1.mlp.experts.0.up_proj.weight",
    "model.visual.merger.proj.weight": "visual.merger.proj.weight",
    "lm_head.weight": "language_model.lm_head.weight",
}
EXPECTED = {"qwen4-exp": QWEN4_EXP, "kimi-k3": KIMI_K3,
            "glm5-next": GLM5_NEXT}
TOYS = ["qwen4-exp", "kimi-k3", "glm5-next"]


def _config(ckpt: Path) -> dict:
    return json.loads((ckpt / "config.json").read_text())


def _tensor_names(ckpt: Path) -> set[str]:
    names: set[str] = set()
    for shard in ckpt.glob("*.safetensors"):
        names |= {k for k in read_header(shard)[0] if k != "__metadata__"}
    return names


def _runtime_tensor(renamer, tensor: str) -> str:
    module, _, suffix = tensor.rpartition(".")
    return f"{renamer.name(module)}.{suffix}"


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("toy", TOYS)
def test_runtime_names_are_the_wheels_mapper(toy, release, toy_factory):
    ckpt = toy_factory(toy)
    expected = EXPECTED[toy]
    assert set(expected) <= _tensor_names(ckpt)  # the toy's own tensors
    renamer = profile("vllm", release).renamer(_config(ckpt))
    assert {t: _runtime_tensor(renamer, t) for t in expected} == expected


def test_kimi_k3_mapper_renames_the_language_model_layers_spelling():
    # The mapper's first entry is for checkpoints that spell the text layers language_model.layers.N (no ".model").
    renamer = profile("vllm", "0.32").renamer({"architectures": ["KimiK3ForConditionalGeneration"]})
    assert renamer.name("language_model.layers.3.self_attn.q_proj") == "language_model.model.layers.3.self_attn.q_proj"


@pytest.mark.parametrize("release", RELEASES)
def test_exclude_is_rewritten_as_apply_list_does(release):
    # QuarkConfig.apply_vllm_mapper: hf_to_vllm_mapper.get_rename_mapper().apply_list(exclude) (quark.py:148);
    # an entry already in runtime form and an mtp.* entry (its None mapping dropped) stay as written.
    p = profile("vllm", release)
    qwen4 = {"architectures": ["Qwen4ExpForConditionalGeneration"]}
    assert p.quant_config_exclude(["model.language_model.layers.0.ple.key_proj",
                                   "language_model.model.layers.0.ple.value_proj", "model.visual.merger.linear_fc1",
                                   "mtp.fc_hidden"], qwen4) == \
        ["language_model.model.layers.0.ple.key_proj", "language_model.model.layers.0.ple.value_proj",
         "visual.merger.linear_fc1", "mtp.fc_hidden"]
    kimi = {"architectures": ["KimiK3ForConditionalGeneration"]}
    assert p.quant_config_exclude(["mm_projector.proj.0", "language_model.model.layers.0.mlp.gate_proj"], kimi) == \
        ["mm_projector.linear_1", "language_model.model.layers.0.mlp.gate_proj"]


# ---- one-spelling exports ---------------------------------------------------------------------------------------

# What each spelling does to a checkpoint module name (None: the entry is written as stored). "vllm": the name vLLM
# builds the module under (the mapper above, applied to "<module>.weight"); "text-only": the text model's prefix
# alone (SGLang's and transformers' spelling), which no vLLM mapper entry rewrites.
SPELL = {
    "qwen4-exp": {"vllm": {"model.language_model.": "language_model.model.", "model.visual.": "visual.",
                           "lm_head.": "language_model.lm_head."},
                  "text-only": {"model.language_model.": "model."}},
    "kimi-k3": {"vllm": {"mm_projector.proj.0.": "mm_projector.linear_1.",
                         "mm_projector.proj.2.": "mm_projector.linear_2."},
                "text-only": {"language_model.model.": "model.", "language_model.lm_head.": "lm_head."}},
    "glm5-next": {"vllm": {"model.language_model.": "language_model.model.", "model.visual.": "visual.",
                           "lm_head.": "language_model.lm_head."}},
}
# Routed experts MXFP4, attention and the QSA indexer FP8 (layer_quant_config keys), the rest BF16 (exclude). Qwen4-Exp's
# indexer takes the attention's scheme: vLLM 0.32 builds index_qk_proj into the attention's qkv_proj (the engine rules).
RECIPE = {"qwen4-exp": "experts-mxfp4-attn-fp8", "kimi-k3": "experts-mxfp4-attn-fp8",
          # vLLM builds GLM-5.3-Flash's attention unquantized (the engine rules): the default recipe keeps it BF16
          "glm5-next": None}


def _respell(name: str, mapping: dict[str, str]) -> str:
    dotted = name + "."
    for old, new in mapping.items():
        if dotted.startswith(old):
            return (new + dotted[len(old):])[:-1]
    return name


@pytest.fixture(scope="module")
def checkpoint_spelled(toy_factory, tmp_path_factory):
    """toy -> its export with exclude and layer_quant_config naming every module once, as stored."""
    from quant.pipeline import quantize_checkpoint
    from tests_engines.cases import one_spelling

    made = {}

    def make(toy):
        if toy not in made:
            root = tmp_path_factory.mktemp(f"spelling-{toy}")
            quantize_checkpoint(toy_factory(toy), root / "export", recipe=RECIPE[toy], log=lambda m: None,
                                check_engines=None)
            one_spelling(root / "export", root / "checkpoint", toy, "checkpoint")
            made[toy] = root / "checkpoint"
        return made[toy]

    return make


def _spelled(src: Path, out: Path, mapping: dict[str, str]) -> tuple[Path, dict]:
    shutil.copytree(src, out)
    config = _config(out)
    q = config["quantization_config"]
    q["exclude"] = [_respell(e, mapping) for e in q["exclude"]]
    q["layer_quant_config"] = {_respell(k, mapping): v for k, v in q["layer_quant_config"].items()}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out, q


def _target_errors(path: Path, config: dict) -> list:
    """vLLM 0.32's errors on the target model (not the MTP layers: GLM-5.3-Flash's draft is not modelled)."""
    from quant.verify import verify_checkpoint

    text = config.get("text_config", config)
    first_mtp = int(text.get("num_hidden_layers") or 0)
    layer = re.compile(r"\blayers\.(\d+)\.")
    report = verify_checkpoint(path, engines=["vllm==0.32"])
    return [f for f in report.errors
            if not ((m := layer.search(f.tensor or "")) and int(m.group(1)) >= first_mtp
                    and text.get("num_nextn_predict_layers"))]


@pytest.mark.parametrize("toy", ["qwen4-exp", "kimi-k3"])
def test_checkpoint_spelling_loads(toy, checkpoint_spelled):
    ckpt = checkpoint_spelled(toy)
    q = _config(ckpt)["quantization_config"]
    assert q["exclude"] and q["layer_quant_config"]
    errors = _target_errors(ckpt, _config(ckpt))
    assert not errors, [f.message for f in errors][:3]


@pytest.mark.parametrize("toy", TOYS)
def test_vllm_runtime_spelling_loads(toy, checkpoint_spelled, tmp_path):
    """Every entry in the names vLLM builds: its mapper leaves them as they are, so they match (a preflight that
    assumes the checkpoint's names predicts every BF16 module of the text model quantized)."""
    out, q = _spelled(checkpoint_spelled(toy), tmp_path / "vllm", SPELL[toy]["vllm"])
    checkpoint_q = _config(checkpoint_spelled(toy))["quantization_config"]
    assert q["exclude"] != checkpoint_q["exclude"]  # the spelling differs from the checkpoint's
    errors = _target_errors(out, _config(out))
    assert not errors, [f.message for f in errors][:3]


@pytest.mark.parametrize("toy", ["qwen4-exp", "kimi-k3"])
def test_text_only_spelling_is_refused(toy, checkpoint_spelled, tmp_path):
    """The text model's own prefix (model.layers.N.*) is neither the checkpoint's nor vLLM's name and no mapper entry
    rewrites it: the BF16 modules it lists are built quantized, and the preflight says so."""
    out, q = _spelled(checkpoint_spelled(toy), tmp_path / "text-only", SPELL[toy]["text-only"])
    assert any(e.startswith("model.layers.") for e in q["exclude"])
    errors = _target_errors(out, _config(out))
    assert errors and all(f.engine == "vllm" for f in errors)
    bf16_text = [f for f in errors if ".layers.0." in (f.tensor or "")]
    assert bf16_text, [f.message for f in errors][:3]


def test_a_split_ple_key_value_pair_is_the_fused_error(checkpoint_spelled, tmp_path):
    """vLLM builds Qwen4-Exp's PLE key_proj / value_proj as one kv_proj (the engine rules packed_modules_mapping): an
    exclude that lists one of them only is the fused module's ValueError."""
    out, q = _spelled(checkpoint_spelled("qwen4-exp"), tmp_path / "split", {})
    config = _config(out)
    config["quantization_config"]["exclude"] = [e for e in q["exclude"] if not e.endswith(".ple.value_proj")]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    errors = _target_errors(out, config)
    assert any("ple.kv_proj" in f.message for f in errors), [f.message for f in errors][:3]


# ---- GLM-5.3-Flash's MTP draft ------------------------------------------------------------------------------------

@pytest.mark.parametrize("release", RELEASES)
def test_glm5_next_draft_builds_the_mtp_layer_as_model_layers(release):
    """Glm5NextMTP builds MTP layer N as model.layers.{N}.* and looks it up in the target's quant config, whose exclude
    the target's mapper rewrote (engine rules vllm mtp.draft_names): the checkpoint-named entry is mapped away from the
    draft's name, so the quantizer writes model.layers.{N}.* too (checked against vLLM's own classes by
    tests_engines/test_vllm_mappers.py)."""
    p = profile("vllm", release)
    config = {"architectures": ["Glm5NextForConditionalGeneration"],
              "text_config": {"num_hidden_layers": 4, "num_nextn_predict_layers": 1}}
    module = "model.language_model.layers.4.mlp.shared_experts.gate_proj"
    assert p.mtp_draft_name(module, config) == "model.layers.4.mlp.shared_experts.gate_proj"
    assert p.quant_config_exclude([module], config) == ["language_model.model.layers.4.mlp.shared_experts.gate_proj"]
    assert p.draft_exclude_names(module, config) == ["model.layers.4.mlp.shared_experts.gate_proj"]
    from quant.engines import exclude_aliases

    assert "model.layers.4.mlp.shared_experts.gate_proj" in exclude_aliases(module, config)
    # a main-model layer is no draft module: no draft name, no draft entry
    assert p.mtp_draft_name("model.language_model.layers.1.mlp.shared_experts.gate_proj", config) is None


@pytest.fixture(scope="module")
def glm5_next_export(toy_factory, tmp_path_factory):
    from quant.pipeline import quantize_checkpoint

    out = tmp_path_factory.mktemp("glm5-next-default") / "export"
    quantize_checkpoint(toy_factory("glm5-next"), out, log=lambda m: None)  # the self-check runs: it must pass
    return out


def test_glm5_next_default_export_loads_with_its_draft(glm5_next_export):
    from quant.verify import verify_checkpoint

    report = verify_checkpoint(glm5_next_export, engines=[f"vllm=={r}" for r in RELEASES])
    assert not report.errors, [f.message for f in report.errors][:3]


def test_glm5_next_draft_needs_the_model_layers_entries(glm5_next_export, tmp_path):
    """Without the model.layers.{N}.* entries the draft's BF16 modules are built quantized in every release (the
    target's mapper turns the checkpoint-named and the language_model.model.* entries into names the draft does not
    use); the main model is unaffected."""
    from quant.verify import verify_checkpoint

    out = tmp_path / "dropped"
    shutil.copytree(glm5_next_export, out)
    config = _config(out)
    first = config["text_config"]["num_hidden_layers"]
    q = config["quantization_config"]
    q["exclude"] = [e for e in q["exclude"] if not e.startswith(f"model.layers.{first}.")]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    errors = verify_checkpoint(out, engines=["vllm==0.32"]).errors
    assert errors and all(f".layers.{first}." in f.tensor for f in errors), [f.tensor for f in errors]
    assert all(f"vLLM builds model.layers.{first}." in f.message for f in errors), errors[0].message
    assert not _target_errors(out, config)
