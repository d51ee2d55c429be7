"""MtpLayout (quant/families/mtp.py): the MTP layout parsed once from a family file and a config.json."""

from __future__ import annotations

import shutil

import pytest

from quant.families import BadData, load_family, mtp_layout
from quant.families.mtp import COUNT_KEYS, DECODER_STACK, NAMESPACE, UNSTATED


def layout(family: str, text: dict, wrapper: bool = False):
    config = {"model_type": family, "text_config": text} if wrapper else {"model_type": family, **text}
    return mtp_layout(config, load_family(family))


def test_deepseek_v3_stores_its_mtp_layers_as_decoder_layers():
    mtp = layout("deepseek_v3", {"num_hidden_layers": 61, "num_nextn_predict_layers": 2})
    assert (mtp.count_key, mtp.count, mtp.storage) == ("num_nextn_predict_layers", 2, DECODER_STACK)
    assert list(mtp.indices) == list(mtp.decoder_layers) == list(mtp.nextn_layers) == [61, 62]
    assert mtp.block(1, "model.") == "model.layers.62."
    assert mtp.keeps("model.layers.61.eh_proj") and mtp.keeps("model.layers.61.shared_head.head")
    assert not mtp.keeps("model.layers.61.mlp.experts.0.gate_proj")
    assert mtp.draft.zero_embedding_at_position_0 and mtp.draft.embed == ("{block}embed_tokens", "{text}embed_tokens")


@pytest.mark.parametrize("family", ["glm4_moe", "glm_moe_dsa", "deepseek_v32", "kimi_k25", "glm5_next"])
def test_the_deepseek_v3_children_inherit_its_layout(family):
    mtp = layout(family, {"num_hidden_layers": 4, "num_nextn_predict_layers": 1})
    assert mtp.storage == DECODER_STACK and list(mtp.decoder_layers) == [4]


def test_glm5_next_draft_is_unsupported_but_its_layers_are_still_mtp_layers():
    mtp = layout("glm5_next", {"num_hidden_layers": 3, "num_nextn_predict_layers": 1})
    assert "transformers" in mtp.draft.unsupported and mtp.draft.block == ""
    assert list(mtp.decoder_layers) == [3] and mtp.keep  # the glue stays BF16 as DeepSeek-V3's


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen4_exp"])
def test_qwen_counts_one_namespaced_layer_none_in_the_decoder_stack(family):
    mtp = layout(family, {"num_hidden_layers": 40, "mtp_num_hidden_layers": 1}, wrapper=True)
    assert (mtp.count_key, mtp.count, mtp.storage) == ("mtp_num_hidden_layers", 1, NAMESPACE)
    assert list(mtp.indices) == [40]  # the engines number it N (vLLM qwen3_5_mtp.py mtp_start_layer_idx)
    assert list(mtp.decoder_layers) == list(mtp.nextn_layers) == []


def test_qwen35_draft_names_and_the_nextn_key_does_not_count_it():
    mtp = layout("qwen3_moe", {"num_hidden_layers": 40, "num_nextn_predict_layers": 3}, wrapper=True)
    assert mtp.count == 0
    two = layout("qwen3_moe", {"num_hidden_layers": 40, "mtp_num_hidden_layers": 2}, wrapper=True)
    assert two.block(1, "model.language_model.") == "mtp.layers.1." and two.draft.proj == "mtp.fc"
    assert two.draft.decoder_config == {"layer_types": ["full_attention"]}


def test_qwen4_exp_keeps_qwen35s_count_but_its_draft_is_unsupported():
    mtp = layout("qwen4_exp", {"num_hidden_layers": 4, "mtp_num_hidden_layers": 1}, wrapper=True)
    assert mtp.draft.unsupported and mtp.count == 1


def test_minimax_m2_counts_its_unpublished_modules_once():
    mtp = layout("minimax_m2", {"num_hidden_layers": 62, "num_mtp_modules": 3, "num_nextn_predict_layers": 5})
    assert (mtp.count_key, mtp.count, mtp.storage) == ("num_mtp_modules", 3, DECODER_STACK)
    assert list(mtp.indices) == [62, 63, 64]  # where vLLM and SGLang look for them (and drop them)
    assert mtp.unpublished and list(mtp.published) == list(mtp.decoder_layers) == list(mtp.nextn_layers) == []
    assert mtp.draft is None
    line = mtp.unpublished_line(["model.layers.0.self_attn.q_proj.weight"])
    assert "3 MTP module(s) (num_mtp_modules)" in line and "--no-mtp" in line and "\n" not in line
    assert mtp.unpublished_line(["model.layers.62.eh_proj.weight"]) is None  # a release that does publish them
    assert layout("minimax_m2", {"num_hidden_layers": 62}).unpublished_line([]) is None  # none declared


def test_minimax_m3_inherits_none_of_m2s_layout():
    mtp = layout("minimax_m3_vl", {"num_hidden_layers": 4, "num_mtp_modules": 7, "num_nextn_predict_layers": 1},
                 wrapper=True)
    assert (mtp.count_key, mtp.count, mtp.storage) == ("num_nextn_predict_layers", 1, UNSTATED)
    assert mtp.unpublished is None and mtp.draft is None


@pytest.mark.parametrize("family", ["deepseek_v4", "kimi_k3", "generic"])
def test_a_family_file_that_says_nothing_gets_the_nextn_convention(family):
    mtp = layout(family, {"num_hidden_layers": 43, "num_nextn_predict_layers": 1})
    assert (mtp.count_key, mtp.storage, mtp.draft) == ("num_nextn_predict_layers", UNSTATED, None)
    assert list(mtp.decoder_layers) == [] and list(mtp.nextn_layers) == [43]


def test_a_config_without_family_or_model_type_is_the_generic_layout():
    mtp = mtp_layout({"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 3,
                      "num_nextn_predict_layers": 2})
    assert mtp.family == "generic" and list(mtp.nextn_layers) == [3, 4]


def test_no_count_without_num_hidden_layers():
    assert layout("deepseek_v3", {"num_nextn_predict_layers": 1}).count == 0


def test_every_family_counts_under_a_known_key():
    from quant.families import all_families

    assert {f.mtp.count_key for f in all_families()} <= set(COUNT_KEYS)
    assert load_family("minimax_m2").mtp.count_key == "num_mtp_modules"


def test_the_engines_and_the_planner_read_the_layout():
    from quant import engines

    qwen = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "text_config": {"num_hidden_layers": 40, "mtp_num_hidden_layers": 1}}
    assert list(engines.mtp_layers(qwen)) == [] and engines.mtp_count_key(qwen) == "mtp_num_hidden_layers"
    minimax = {"model_type": "minimax_m2", "num_hidden_layers": 62, "num_mtp_modules": 3}
    assert list(engines.mtp_layers(minimax)) == []
    glm = {"model_type": "glm_moe_dsa", "num_hidden_layers": 78, "num_nextn_predict_layers": 1}
    assert list(engines.mtp_layers(glm)) == [78]


# ------------------------------------------------------------------------------------------ strict parsing


def family_file(tmp_path, monkeypatch, body: str) -> str:
    import quant.families as families

    shutil.copytree(families.families_dir(), tmp_path / "families")
    (tmp_path / "families" / "mine.yaml").write_text("family: mine\ninherit: generic\n" + body)
    monkeypatch.setattr(families, "families_dir", lambda: tmp_path / "families")
    return str(tmp_path / "families" / "mine.yaml")


@pytest.mark.parametrize("body,message", [
    # a second count key, as minimax_m2.yaml once named one in mtp_draft and another in mtp_unpublished
    ("mtp_draft: {count_key: num_mtp_modules, unsupported: x}\n", "unknown key 'count_key' in mtp_draft"),
    ("mtp_unpublished: {count_keys: [num_mtp_modules], reason: x}\n", "unknown key 'count_keys' in mtp_unpublished"),
    ("mtp: {namespace: 'mtp.', count_key: num_mtp_layers}\n", "mtp.count_key 'num_mtp_layers' is not one of"),
    ("mtp: {count_key: num_mtp_modules}\n", "one of first_layer_key"),
    ("mtp: {first_layer_key: num_hidden_layers, namespace: 'mtp.'}\n", "one of first_layer_key"),
    ("mtp: {namespace: 'mtp.', keep: ['(']}\n", "mtp.keep: invalid regex"),
    ("mtp_draft: {block: '{text}layers.{n}.'}\n", "mtp_draft is missing embed_norm"),
    ("mtp_unpublished: {reason: 3}\n", "needs a reason"),
])
def test_a_bad_mtp_section_is_named_with_its_file(tmp_path, monkeypatch, body, message):
    path = family_file(tmp_path, monkeypatch, body)
    with pytest.raises(BadData, match=message) as e:
        load_family("mine")
    assert str(e.value).startswith(path)


def test_a_section_replaces_the_parents_and_null_drops_it(tmp_path, monkeypatch):
    family_file(tmp_path, monkeypatch, "")
    (tmp_path / "families" / "mine.yaml").write_text(
        "family: mine\ninherit: deepseek_v3\nmtp_draft: null\n")
    mine = load_family("mine")
    assert mine.mtp.first_layer_key == "num_hidden_layers" and mine.mtp.keep and mine.mtp.draft is None
