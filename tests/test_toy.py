"""Toy checkpoints: names, dtypes and shapes per family, block-FP8 source, shards, determinism, tokenizer,
reload with transformers, CLI errors."""

from __future__ import annotations

import json
import os
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from quant.checkpoint import open_checkpoint, text_config
from quant.errors import QuantError
from quant.toy import TOY_NAMES, build_toy, toy_family
from quant.toy.tokenizer import VOCAB_SIZE

pytestmark = pytest.mark.xdist_group("toy")

GSM8K_STYLE = ("Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
               "in May. How many clips did Natalia sell altogether?\nAnswer: In May she sold 48/2 = 24 clips.\n"
               "48+24 = 72 #### 72")


@pytest.fixture(scope="module")
def bf16_toys(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bf16")
    return {name: build_toy(name, root / name) for name in TOY_NAMES}


@pytest.fixture(scope="module")
def fp8_toys(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8")
    # Layout toys (no transformers class: Kimi-K3) have no block-FP8 release and refuse --fp8-block.
    # Toys stored in their own release format (MiniMax-M3.1-Flash's NVFP4) refuse --fp8-block as well.
    return {name: build_toy(name, root / name, fp8_block=True) for name in TOY_NAMES
            if toy_family(name).config_class and not toy_family(name).release_format}


def read_all(path: Path) -> dict[str, torch.Tensor]:
    checkpoint = open_checkpoint(path)
    out = {}
    for file in checkpoint.files:
        with safe_open(str(path / file), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def config_of(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def dequantize_block(q: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> torch.Tensor:
    # The official contract, written independently of quant.numerics: w[i, j] = q[i, j] * scale_inv[i//128, j//128].
    o, i = q.shape
    scale = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[:o, :i]
    return q.float() * scale


# ---------------------------------------------------------------------------------------------- names per family


def test_glm5_layout_has_indexer_and_mtp_without_embed_or_head_copies(bf16_toys):
    checkpoint = open_checkpoint(bf16_toys["glm5"])
    config, tensors = checkpoint.config, checkpoint.tensors
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    assert config["model_type"] == "glm_moe_dsa" and config["num_nextn_predict_layers"] == 1
    assert all(len(config[k]) == n for k in ("layer_types", "mlp_layer_types", "indexer_types"))
    assert "model.layers.0.mlp.gate_proj.weight" in tensors  # dense first layer
    for layer in range(n + 1):
        for leaf in ("wq_b.weight", "wk.weight", "weights_proj.weight", "k_norm.weight", "k_norm.bias"):
            assert f"model.layers.{layer}.self_attn.indexer.{leaf}" in tensors
    mtp = f"model.layers.{n}."
    for leaf in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight", "self_attn.kv_b_proj.weight",
                 "mlp.gate.weight", "mlp.shared_experts.down_proj.weight", "mlp.experts.7.up_proj.weight"):
        assert mtp + leaf in tensors
    assert tensors[mtp + "eh_proj.weight"].shape == (hidden, 2 * hidden)
    assert mtp + "embed_tokens.weight" not in tensors and mtp + "shared_head.head.weight" not in tensors
    assert not any(name.startswith(f"model.layers.{n + 1}.") for name in tensors)


def test_glm5_next_layout_as_released_and_a_strict_transformers_load(bf16_toys):
    """GLM-5.3-Flash: KDA layers, an MLA (NoPE) + DSA-indexer layer, mHC, and an MTP layer shaped like SGLang's
    NextN draft (no mHC); transformers 5.24 loads every weight it has a parameter for and nothing is missing."""
    import transformers

    path = bf16_toys["glm5-next"]
    checkpoint = open_checkpoint(path)
    config, tensors = checkpoint.config, checkpoint.tensors
    text = config["text_config"]
    n, hidden = text["num_hidden_layers"], text["hidden_size"]
    assert config["model_type"] == "glm5_next" and text["num_nextn_predict_layers"] == 1 and text["mhc"]
    assert text["qk_rope_head_dim"] == 0 and text["head_dim"] == 0  # NoPE MLA
    assert all(len(text[k]) == n for k in ("layer_types", "mlp_layer_types", "indexer_types"))
    kda, mla, mtp = "model.language_model.layers.0.", f"model.language_model.layers.{n - 1}.", \
        f"model.language_model.layers.{n}."
    for leaf in ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj", "o_proj"):
        assert tensors[f"{kda}self_attn.{leaf}.weight"].dtype == "BF16"
    for leaf in ("q_conv1d.weight", "A_log", "dt_bias"):
        assert tensors[f"{kda}self_attn.{leaf}"].dtype == "F32"
    assert tensors[f"{kda}hc_attn_fn"].dtype == "BF16" and tensors[f"{kda}hc_ffn_base"].dtype == "F32"
    # the MLA layer's kv_a_proj_with_mqa holds no RoPE rows (kv_lora_rank only)
    assert tensors[f"{mla}self_attn.kv_a_proj_with_mqa.weight"].shape == (text["kv_lora_rank"], hidden)
    assert tensors[f"{mla}self_attn.indexer.index_kpool_compress_ape"].dtype == "F32"
    assert tensors[f"{mla}mlp.gate.weight"].dtype == "F32"
    for leaf in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                 "self_attn.indexer.wk.weight", "mlp.experts.0.down_proj.weight"):
        assert mtp + leaf in tensors
    assert not any(name.startswith(mtp + "hc_") for name in tensors)
    assert any(name.startswith("model.visual.blocks.0.") for name in tensors) and "lm_head.weight" in tensors
    model, info = transformers.Glm5NextForConditionalGeneration.from_pretrained(path, output_loading_info=True)
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert all(k.startswith(mtp) for k in info["unexpected_keys"])  # the MTP layer, which transformers does not build
    assert not info["mismatched_keys"]


def test_deepseek_v3_mtp_layer_copies_embedding_and_head(bf16_toys):
    path = bf16_toys["deepseek-v3"]
    config, tensors = config_of(path), read_all(path)
    n = config["num_hidden_layers"]
    assert config["num_nextn_predict_layers"] == 1
    mtp = f"model.layers.{n}."
    assert torch.equal(tensors[mtp + "embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    assert torch.equal(tensors[mtp + "shared_head.head.weight"], tensors["lm_head.weight"])
    for leaf in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "mlp.experts.0.gate_proj.weight", "self_attn.q_b_proj.weight"):
        assert mtp + leaf in tensors
    assert not any(".indexer." in name for name in tensors)


@pytest.mark.parametrize("name", ["glm5", "deepseek-v3"])
def test_routing_bias_is_f32_and_learned_looking(bf16_toys, name):
    tensors = read_all(bf16_toys[name])
    biases = {k: v for k, v in tensors.items() if k.endswith("e_score_correction_bias")}
    assert len(biases) == 2  # MoE layer 1 and the MTP layer
    for value in biases.values():
        assert value.dtype == torch.float32 and value.abs().sum() > 0


def test_qwen3_moe_stores_per_expert_tensors(bf16_toys):
    checkpoint = open_checkpoint(bf16_toys["qwen3-moe"])
    config, tensors = checkpoint.config, checkpoint.tensors
    experts, hidden, inter = config["num_experts"], config["hidden_size"], config["moe_intermediate_size"]
    for layer in range(config["num_hidden_layers"]):
        for e in range(experts):
            prefix = f"model.layers.{layer}.mlp.experts.{e}."
            assert tensors[prefix + "gate_proj.weight"].shape == (inter, hidden)
            assert tensors[prefix + "down_proj.weight"].shape == (hidden, inter)
        assert f"model.layers.{layer}.self_attn.q_norm.weight" in tensors
    assert not any("gate_up_proj" in name or "shared_expert" in name for name in tensors)


def test_qwen35_stores_fused_3d_experts_and_both_attention_kinds(bf16_toys):
    checkpoint = open_checkpoint(bf16_toys["qwen3.5-fused"])
    config, tensors = checkpoint.config, checkpoint.tensors
    e, h, i = config["num_experts"], config["hidden_size"], config["moe_intermediate_size"]
    assert config["model_type"] == "qwen3_5_moe_text"
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp."
        assert tensors[prefix + "experts.gate_up_proj"].shape == (e, 2 * i, h)
        assert tensors[prefix + "experts.down_proj"].shape == (e, h, i)
        assert tensors[prefix + "shared_expert_gate.weight"].shape == (1, h)
        assert prefix + "shared_expert.down_proj.weight" in tensors
    assert not any(re.search(r"experts\.\d+\.", name) for name in tensors)
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in tensors
    assert "model.layers.1.self_attn.q_proj.weight" in tensors
    assert config["layer_types"] == ["linear_attention", "full_attention"]


def test_qwen4_exp_stores_the_release_layout(bf16_toys):
    """Qwen3.8-Flash-Next (qwen4_exp) as released: the Qwen3.5 wrapper's names, per-expert experts and each PLE
    n-gram table as split_ngram_parts row shards (transformers 5.24 conversion_mapping.py "qwen4_exp_text"), the
    I64 hash buffers, hyper-connections instead of a final norm, the QSA indexer on full-attention layers only, and
    the MTP head under the names SGLang 0.5.23's Qwen4ExpForCausalLMMTP loads (qwen4_exp_mtp.py)."""
    checkpoint = open_checkpoint(bf16_toys["qwen4-exp"])
    config, tensors = checkpoint.config, checkpoint.tensors
    text = config["text_config"]
    h, hc = text["hidden_size"], text["hc_count"]
    assert config["model_type"] == "qwen4_exp" and config["architectures"] == ["Qwen4ExpForConditionalGeneration"]
    assert text["layer_types"] == ["linear_attention", "full_attention"]  # the release's spelling
    assert text["mtp_num_hidden_layers"] == 1 and text["ple_layer_ids"] == [1]
    lm = "model.language_model."
    table = f"{lm}layers.0.ple.ple_embedding."
    shards = [n for n in tensors if n.startswith(table + "ngram_embedding.")]
    assert shards == [f"{table}ngram_embedding.shard_{j}.weight" for j in range(text["split_ngram_parts"])]
    heads = (text["ngram_size"] - 1) * text["heads_per_ngram"]
    assert {tensors[s].shape for s in shards} == {(512 // len(shards), text["ple_embed_dim"] // heads)}
    for buffer in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets"):
        assert tensors[table + buffer].dtype == "I64"
    assert not any(".ple." in n for n in tensors if n.startswith(f"{lm}layers.1."))  # PLE on layer 0 only
    for layer in range(text["num_hidden_layers"]):
        for hcname in ("attn_hyper_connection", "mlp_hyper_connection"):
            assert tensors[f"{lm}layers.{layer}.{hcname}.block_inject_weight.weight"].shape == (hc, hc * h)
        assert f"{lm}layers.{layer}.mlp.experts.7.down_proj.weight" in tensors
        assert f"{lm}layers.{layer}.input_layernorm.weight" not in tensors
    assert f"{lm}layers.1.self_attn.indexer.index_qk_proj.weight" in tensors
    assert not any(".indexer." in n for n in tensors if n.startswith(f"{lm}layers.0."))
    assert f"{lm}hyper_connection_mixer.input_mix_weight_down.weight" in tensors and f"{lm}norm.weight" not in tensors
    assert not any("gate_up_proj" in n for n in tensors)
    glue = {n for n in tensors if n.startswith("mtp.") and not n.startswith("mtp.layers.0.")}
    assert glue == {"mtp.fc_embedding.weight", "mtp.fc_hidden.weight", "mtp.pre_fc_norm_embedding.weight",
                    "mtp.pre_fc_norm_hidden.weight", "mtp.hyper_connection_mixer.hc_norm.weight",
                    "mtp.hyper_connection_mixer.input_mix_weight_down.weight",
                    "mtp.hyper_connection_mixer.input_mix_weight_up.weight"}
    assert tensors["mtp.pre_fc_norm_hidden.weight"].shape == (hc * h,)
    assert "mtp.layers.0.self_attn.indexer.index_qk_proj.weight" in tensors
    assert not any(".ple." in n for n in tensors if n.startswith("mtp."))
    assert {t.dtype for n, t in tensors.items() if "ngram_heads" not in n and "multipliers" not in n} == {"BF16"}


@pytest.mark.parametrize("name", TOY_NAMES)
def test_linear_input_dims_fit_mxfp4_and_leave_partial_fp8_tiles(bf16_toys, name):
    from quant.sources.registry import recognise, scale_tensors

    from quant.families import load_family
    from quant.families.sidecars import sidecar_pattern

    tensors = open_checkpoint(bf16_toys[name]).tensors
    scales = scale_tensors(tensors)  # a microscaled release (DeepSeek-V4): decoded shapes, E8M0 scales not linears
    # Sidecar tables (DeepSeek-V4.1's Engram embeddings) are no linears: carried over as stored, never quantized.
    sidecar = sidecar_pattern(load_family(toy_family(name).family).sidecars)
    tensors = {k: t for k, t in tensors.items() if sidecar is None or not sidecar.match(k)}
    # Convolutions (linear attention's conv1d, the vision patch embedding) are not linears; nor is a hash-routing table.
    linear = {k: (recognise(tensors, k) or t).shape for k, t in tensors.items()
              if len(t.shape) == 2 or (len(t.shape) == 3 and "experts" in k)
              if "conv1d" not in k and "embed_tokens" not in k and "patch_embed" not in k and "tid2eid" not in k
              and k not in scales}
    bad = {k: s for k, s in linear.items() if s[-1] % 32}
    assert not bad, f"Linear input dims not a multiple of 32: {bad}"
    inputs = {s[-1] for s in linear.values()}
    vocab = text_config(config_of(bf16_toys[name]))["vocab_size"]
    outputs = {s[-2] for s in linear.values() if s[-2] != vocab}  # not the head: vocab is never a tile count
    assert any(d % 128 for d in inputs) and any(d >= 128 for d in inputs)
    assert any(d % 128 for d in outputs)
    # The byte tokenizer's ids; the VL wrappers add their image/video ids above them (four for Qwen3.5, Kimi-K2.5 and
    # MiniMax-M3; six for GLM-5.3-Flash: image/video, and the start/end of each).
    media = {"glm5-next": 6}.get(name, 4) if toy_family(name).text_config_key else 0
    assert vocab == VOCAB_SIZE + media


@pytest.mark.parametrize("name", TOY_NAMES)
def test_each_toy_is_its_family_files_record(bf16_toys, name):
    """A toy lives beside its family's record: the family its config.json resolves to holds it, names the
    architecture class it is written with, and counts its MTP layers as the toy built them (quant.families.mtp_layout,
    the one count)."""
    from quant.families import family_for_config, mtp_layout

    toy = toy_family(name)
    checkpoint = open_checkpoint(bf16_toys[name])
    family = family_for_config(checkpoint.config)
    assert family.name == toy.family and toy.file.parent.name == "toys" and toy.file.stem == family.name
    assert checkpoint.config["architectures"][0] in family.architectures[checkpoint.config["model_type"]]
    mtp = mtp_layout(checkpoint.config, family)
    # MiniMax-M2's config declares MTP modules no release publishes (the toy builds none, as the release)
    assert mtp.count == toy.mtp_layers or mtp.unpublished_line(checkpoint.tensors)
    for layer in mtp.decoder_layers:  # stored in the decoder stack: model.layers.{N + k}
        assert any(f"layers.{layer}." in n for n in checkpoint.tensors)
    if toy.mtp is not None:
        assert mtp.in_decoder_stack == ("{n}" in toy.mtp.layer_prefix) and mtp.count_key == toy.mtp.count_key


def test_the_mtp_count_key_of_a_namespaced_head_is_the_familys(tmp_path):
    """Qwen3.5's MTP head is counted by text_config.mtp_num_hidden_layers (family data), and an override of that key
    reshapes the toy."""
    from quant.families import mtp_layout

    two = open_checkpoint(build_toy("qwen3.5", tmp_path / "two", overrides={"mtp_num_hidden_layers": 2}))
    assert mtp_layout(two.config).count == 2 and "mtp.layers.1.mlp.gate.weight" in two.tensors


# ---------------------------------------------------------------------------------------------------- FP8 source


@pytest.mark.parametrize("name", TOY_NAMES)
def test_fp8_block_source_matches_the_official_contract(fp8_toys, bf16_toys, name):
    release = toy_family(name).fp8
    if not release.quantize:
        pytest.skip(f"{name}: no official block-FP8 release to reproduce")
    path = fp8_toys[name]
    fp8, config = read_all(path), config_of(path)
    qc = config["quantization_config"]
    assert (qc["quant_method"], qc["fmt"], qc["activation_scheme"], qc["weight_block_size"]) == \
        ("fp8", "e4m3", "dynamic", [128, 128])

    quantized = [k for k in fp8 if release.quantizes(k)]
    assert quantized
    partial_tiles = 0
    for key in quantized:
        weight, scale_inv = fp8[key], fp8[key + "_scale_inv"]
        o, i = weight.shape
        assert weight.dtype == torch.float8_e4m3fn
        assert scale_inv.dtype == torch.float32 and scale_inv.shape == (math.ceil(o / 128), math.ceil(i / 128))
        partial_tiles += bool(o % 128 or i % 128)
    assert partial_tiles
    for key, value in fp8.items():
        if key.endswith("_scale_inv"):
            assert key.removesuffix("_scale_inv") in quantized
        elif key not in quantized:
            assert value.dtype in (torch.bfloat16, torch.float32), key

    # Router, norms, bias, indexer weights_proj/k_norm, eh_proj, embedding and head stay unquantized.
    never = re.compile(r"(norm\.(weight|bias)|mlp\.gate\.|shared_expert_gate|weights_proj|eh_proj|embed_tokens|"
                       r"lm_head|e_score_correction_bias|in_proj_[ab]\.)")
    assert not [k for k in quantized if never.search(k)]
    if toy_family(name).mtp_layers and not toy_family(name).text_config_key:
        n = config["num_hidden_layers"]
        for leaf in ("self_attn.kv_b_proj.weight", "self_attn.k_proj.weight", "mlp.experts.3.down_proj.weight",
                     "mlp.shared_experts.up_proj.weight"):
            if f"model.layers.1.{leaf}" in quantized:  # the MTP layer is quantized like the main layers
                assert f"model.layers.{n}.{leaf}" in quantized

    # Same seed: dequantized FP8 weights are the BF16 toy's weights up to e4m3 rounding.
    bf16 = read_all(bf16_toys[name])
    if toy_family(name).fused_experts:
        bf16 = unfuse_experts(bf16)
    assert set(bf16) == {k for k in fp8 if not k.endswith("_scale_inv")}
    for key in quantized:
        reference = bf16[key].float()
        error = (dequantize_block(fp8[key], fp8[key + "_scale_inv"]) - reference).norm() / reference.norm()
        assert error < 0.05, (key, float(error))
    for key in set(bf16) - set(quantized):
        assert torch.equal(bf16[key], fp8[key]), key


def unfuse_experts(tensors: dict) -> dict:
    out = {}
    for key, value in tensors.items():
        if key.endswith("mlp.experts.gate_up_proj"):
            prefix = key.removesuffix("gate_up_proj")
            for e, (gate, up) in enumerate(v.chunk(2, dim=0) for v in value):
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = gate, up
        elif key.endswith("mlp.experts.down_proj"):
            prefix = key.removesuffix("down_proj")
            for e, down in enumerate(value):
                out[f"{prefix}{e}.down_proj.weight"] = down
        else:
            out[key] = value
    return out


def test_fp8_modules_to_not_convert_follow_each_release(fp8_toys):
    glm = config_of(fp8_toys["glm5"])["quantization_config"]["modules_to_not_convert"]
    assert glm[:2] == ["lm_head", "model.embed_tokens"]
    assert [f"model.layers.{i}.self_attn.indexers_proj" for i in range(3)] == glm[2:]  # misspelled, as shipped
    assert "modules_to_not_convert" not in config_of(fp8_toys["deepseek-v3"])["quantization_config"]
    qwen35 = config_of(fp8_toys["qwen3.5-fused"])["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.0.linear_attn.in_proj_a" in qwen35
    assert "model.layers.1.linear_attn.in_proj_a" not in qwen35  # layer 1 is a full-attention layer


@pytest.mark.parametrize("name", TOY_NAMES)
def test_transformers_loads_every_fp8_toy_weight_from_the_checkpoint(fp8_toys, bf16_toys, name):
    # transformers 5.23 dequantizes on CPU but infers the block size from the scale grid (rows // scale_rows),
    # which misplaces scales on partial 128-tiles, so its weights are only loosely close to the BF16 toy; the
    # bound still catches a weight left at random init (error ~1.4) or a module converted without its scale.
    from transformers import AutoModelForCausalLM

    if not toy_family(name).fp8.quantize:
        pytest.skip(f"{name}: no official block-FP8 release to reproduce")
    if name == "deepseek-v3":
        # The real DeepSeek-V3 kv_a_proj_with_mqa is [576, 7168] with a [5, 56] scale grid; transformers 5.23
        # divides rows by scale rows and refuses it. The toy keeps the real 576 rows (vLLM's CPU MLA needs
        # them), so the reference oracle is unavailable here, which this asserts rather than skips.
        with pytest.raises(RuntimeError, match="automatic conversion"):
            AutoModelForCausalLM.from_pretrained(fp8_toys[name])
        return
    bf16 = AutoModelForCausalLM.from_pretrained(bf16_toys[name]).state_dict()
    model = AutoModelForCausalLM.from_pretrained(fp8_toys[name])
    fp8 = model.state_dict()
    assert fp8.keys() == bf16.keys()
    for key, reference in bf16.items():
        error = (fp8[key].float() - reference.float()).norm() / reference.float().norm()
        assert error < 0.2, (key, float(error))
    with torch.no_grad():
        assert model(torch.tensor([[72, 105, 32, 52, 50]])).logits.isfinite().all()


# ------------------------------------------------------------------------------------- shards, determinism, I/O


def test_shards_with_a_valid_index(tmp_path):
    path = build_toy("glm5", tmp_path / "toy", shard_size="500KB", fp8_block=True)
    checkpoint = open_checkpoint(path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(checkpoint.files) > 1 and not checkpoint.problems
    assert set(index["weight_map"]) == set(checkpoint.tensors)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in checkpoint.tensors.values())
    for file in checkpoint.files:
        shard = checkpoint.shard_tensors(file)
        assert len(shard) == 1 or sum(t.nbytes for t in shard) <= 500_000
        with safe_open(str(path / file), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}


def test_same_seed_gives_identical_bytes_and_another_seed_differs(tmp_path):
    def files(path):
        return {p.name: p.read_bytes() for p in sorted(path.iterdir())}

    a = files(build_toy("glm5", tmp_path / "a", fp8_block=True, shard_size=800_000, seed=3))
    b = files(build_toy("glm5", tmp_path / "b", fp8_block=True, shard_size=800_000, seed=3))
    c = files(build_toy("glm5", tmp_path / "c", fp8_block=True, shard_size=800_000, seed=4))
    assert a == b
    shards = [name for name in a if name.endswith(".safetensors")]
    assert len(shards) > 1 and a.keys() == c.keys()
    assert all(a[shard] != c[shard] for shard in shards)


def test_overrides_reshape_the_model_and_the_mtp_layer(tmp_path):
    deeper = open_checkpoint(build_toy("glm5", tmp_path / "deeper", overrides={"num_hidden_layers": 3}))
    assert deeper.config["num_hidden_layers"] == 3 and "model.layers.3.eh_proj.weight" in deeper.tensors
    no_mtp = open_checkpoint(build_toy("deepseek-v3", tmp_path / "no-mtp", overrides={"num_nextn_predict_layers": 0}))
    assert no_mtp.config["num_nextn_predict_layers"] == 0
    assert not any(k.startswith("model.layers.2.") for k in no_mtp.tensors)
    with pytest.raises(QuantError, match="vocab_size"):
        build_toy("glm5", tmp_path / "small-vocab", overrides={"vocab_size": 100})
    with pytest.raises(QuantError, match="MTP"):
        build_toy("qwen3-moe", tmp_path / "qwen-mtp", overrides={"num_nextn_predict_layers": 1})


def test_a_failed_build_leaves_no_output(tmp_path, monkeypatch):
    import quant.toy.build

    def crash(directory):
        raise RuntimeError("disk full")

    monkeypatch.setattr(quant.toy.build, "save_toy_tokenizer", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        build_toy("qwen3-moe", tmp_path / "toy")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------- tokenizer and reload


def test_tokenizer_loads_offline_and_round_trips(bf16_toys, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = bf16_toys["glm5"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(GSM8K_STYLE)["input_ids"]
    assert tokenizer.decode(ids) == GSM8K_STYLE
    assert len(tokenizer("#### 1234")["input_ids"]) == 9  # one token per character, digits included
    assert len(tokenizer) == VOCAB_SIZE == config_of(path)["vocab_size"]
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.eos_token_id == config_of(path)["eos_token_id"]
    assert generation["pad_token_id"] == tokenizer.pad_token_id != tokenizer.eos_token_id


@pytest.mark.parametrize("name", TOY_NAMES)
def test_reloads_with_transformers_and_gives_finite_logits(bf16_toys, name):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    from quant.process import usable_cpu_attention

    import transformers

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    path = bf16_toys[name]
    # A layout toy (Kimi-K3), or a toy built from a transformers decoder but written as a release transformers has no
    # class for (DeepSeek-V4.1: `release_extras`).
    if toy_family(name).config_class is None or config_of(path)["model_type"] not in CONFIG_MAPPING_NAMES:
        _check_layout_toy_without_transformers(path)
        return
    if toy_family(name).release_format:
        path = _decoded_copy(path, path.parent / f"{name}-decoded")
    # VL wrappers without an AutoModelForCausalLM mapping (Kimi-K2.5, MiniMax-M3) load through their own class, or
    # through the image-text-to-text auto class where the release spells the class otherwise (Kimi-K2.5's
    # KimiK25ForConditionalGeneration).
    config = config_of(path)
    auto = AutoModelForImageTextToText if config["model_type"] in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES \
        else AutoModelForCausalLM
    cls = getattr(transformers, config["architectures"][0], auto)
    usable_cpu_attention()  # as the eval loads a model: torch's AMX attention under a forced AVX2 ISA cannot run
    model = cls.from_pretrained(path)
    ids = AutoTokenizer.from_pretrained(path)(GSM8K_STYLE[:64], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert model.dtype == torch.bfloat16
    assert logits.shape == (1, 64, text_config(config_of(path))["vocab_size"]) and logits.isfinite().all()


def _decoded_copy(path: Path, out: Path) -> Path:
    """A toy stored as its release stores it (MiniMax-M3.1-Flash: ModelOpt NVFP4 experts, which transformers 5.24
    builds as BF16 and fails to load, "size mismatch"), with every microscaled weight decoded by quant.sources and
    its scales dropped: what transformers reloads, so names, shapes and decoded values are checked as the BF16
    toys' are."""
    import shutil

    from safetensors.torch import load_file, save_file

    from quant.sources import registry

    shutil.copytree(path, out)
    ckpt = open_checkpoint(path)
    scales = registry.scale_tensors(ckpt.tensors)
    for shard in sorted(path.glob("*.safetensors")):
        tensors, decoded = load_file(str(shard)), {}
        for name, t in tensors.items():
            enc = registry.recognise(ckpt.tensors, name) if name not in scales else None
            if enc is not None:
                glob = tensors.get(enc.global_scale) if enc.global_scale else None
                decoded[f"{enc.module}.weight"] = registry.decode(enc, t, tensors[enc.scale], name, glob).to(torch.bfloat16)
            elif name not in scales:
                decoded[name] = t
        save_file(decoded, str(out / shard.name), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def _check_layout_toy_without_transformers(path: Path) -> None:
    """The exemption of a layout toy (a toy's `layout`: Kimi-K3) from the transformers reload: transformers has no
    class for its model_type, so no strict load applies. Asserted, so the exemption fails once transformers gains the
    class. What still holds here: the checkpoint agrees with its own config.json as every engine reads it (the
    preflight's consistency checks: every declared layer and expert stored, each expert sized from the config), and
    the engine that runs it is named by the data (the engine rules config_registry). SGLang 0.5.23 builds and loads it
    with its own loaders, compared tensor by tensor, in tests_engines/test_sglang.py (-k kimi-k3)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from quant.verify.shapes import consistency_findings, engine_registered

    config = config_of(path)
    assert config["model_type"] not in CONFIG_MAPPING_NAMES, "transformers has this class now: drop the exemption"
    assert "sglang==0.5.23" in engine_registered(config["model_type"])
    assert [f.message for f in consistency_findings(open_checkpoint(path)) if f.severity == "error"] == []


# --------------------------------------------------------------------------------------------------------- CLI


def run_cli(*args):
    import typer
    from typer.testing import CliRunner

    from quant.commands.toy import command

    app = typer.Typer()
    app.command()(command)
    return CliRunner().invoke(app, [str(a) for a in args])


def test_cli_rejects_an_unknown_name(tmp_path):
    result = run_cli("glm6", tmp_path / "toy")
    assert isinstance(result.exception, QuantError)
    assert all(name in str(result.exception) for name in TOY_NAMES)
    assert not (tmp_path / "toy").exists()


def test_cli_writes_a_summary_and_refuses_to_overwrite_without_the_flag(tmp_path):
    out = tmp_path / "toy"
    result = run_cli("qwen3-moe", out, "--shard-size", "1MB", "--seed", "1")
    assert result.exit_code == 0, result.output
    assert re.search(r"69 tensors, 3 shard\(s\), \d+\.\d\d MB", result.output)

    result = run_cli("qwen3-moe", out)  # other options than the toy there: refused, named flag
    assert isinstance(result.exception, QuantError) and "--overwrite" in str(result.exception)
    assert run_cli("qwen3-moe", out, "--force").exit_code == 2  # one meaning per flag: --force is push's
    assert run_cli("qwen3-moe", out, "--overwrite").exit_code == 0
    assert (out / "model.safetensors").exists() and not (out / "model.safetensors.index.json").exists()

    result = run_cli("qwen3-moe", tmp_path / "other", "--shard-size", "lots")
    assert isinstance(result.exception, QuantError) and "lots" in str(result.exception)


def test_a_toy_built_before_is_copied_with_the_same_bytes(tmp_path):
    """Issue #50 item 8: building imports torch and the family's transformers model (about 3.4 of 3.7 s here); the
    same options, code and libraries give the same bytes, so `quant toy` keeps each toy it builds and copies it the
    next time. A kept file that is not as recorded is never copied: the toy is built again."""
    import subprocess
    import sys

    env = {**os.environ, "QUANT_CACHE_DIR": str(tmp_path / "cache")}

    def toy(out):
        run = subprocess.run([sys.executable, "-m", "quant", "toy", "glm5", str(tmp_path / out)], env=env,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        return {p.name: p.read_bytes() for p in (tmp_path / out).iterdir() if not p.name.startswith(".")}

    built = toy("a")
    [kept] = list((tmp_path / "cache" / "toys").iterdir())
    assert toy("b") == built
    shard = kept / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1] + b"\x01")  # the cache damaged: not copied, built again
    assert toy("c") == built
