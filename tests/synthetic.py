"""Header-only Quark checkpoints for tests and benchmarks.

`write_sparse_safetensors` writes a real safetensors header and `truncate`s the file to its full size, so the
file is valid for any header reader (offsets fit the file) but holds no data: a GLM-5.2-sized layout takes
seconds and almost no disk. `glm_moe_dsa_layout` lists the BF16 tensors of a glm_moe_dsa model (names as in the
zai-org/GLM-5.1 listing) and `quark_layout` turns selected modules into Quark MXFP4/FP8 tensors, as the quantizer
writes them.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from quant.checkpoint import DTYPE_BYTES, INDEX_FILE
from quant.engines import exclude_aliases, split_mtp

TensorSpecs = dict[str, tuple[str, tuple[int, ...]]]  # name -> (safetensors dtype, shape)


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    n = DTYPE_BYTES[dtype]
    for d in shape:
        n *= d
    return n


def write_sparse_safetensors(path: Path, tensors: TensorSpecs) -> int:
    """Write a safetensors file whose data region is a hole; returns the file size."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = _nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        f.truncate(8 + len(blob) + offset)
    return 8 + len(blob) + offset


def write_checkpoint(out: Path, config: dict, tensors: TensorSpecs, shards: int = 1) -> Path:
    """A checkpoint directory: config.json, `shards` sparse shards and (for more than one) the index."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    names = list(tensors)
    if shards <= 1:
        write_sparse_safetensors(out / "model.safetensors", tensors)
        return out
    per = -(-len(names) // shards)
    weight_map, total = {}, 0
    for i in range(shards):
        chunk = names[i * per:(i + 1) * per]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_sparse_safetensors(out / file, {n: tensors[n] for n in chunk})
        for n in chunk:
            weight_map[n] = file
            total += _nbytes(*tensors[n])
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return out


def glm_moe_dsa_config(num_hidden_layers: int = 3, *, hidden: int = 64, experts: int = 4, moe_inter: int = 32,
                       inter: int = 128, heads: int = 2, q_lora: int = 64, kv_lora: int = 32, nope: int = 32,
                       rope: int = 32, v_head: int = 32, index_heads: int = 2, index_dim: int = 32,
                       first_k_dense: int = 1, nextn: int = 1) -> dict:
    return {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
        "num_hidden_layers": num_hidden_layers, "num_nextn_predict_layers": nextn, "hidden_size": hidden,
        "intermediate_size": inter, "moe_intermediate_size": moe_inter, "n_routed_experts": experts,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": first_k_dense,
        "num_attention_heads": heads, "num_key_value_heads": heads, "q_lora_rank": q_lora,
        "kv_lora_rank": kv_lora, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": v_head,
        "index_n_heads": index_heads, "index_head_dim": index_dim, "vocab_size": 256, "torch_dtype": "bfloat16",
    }


def glm_moe_dsa_layout(config: dict) -> TensorSpecs:
    """BF16 tensors of a glm_moe_dsa checkpoint including its MTP layers (no embed/head copies in MTP)."""
    c = config
    H, V = c["hidden_size"], c["vocab_size"]
    NH, R, Dn, Dv = c["num_attention_heads"], c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]
    Iq, Ikv, E, I, Id = c["q_lora_rank"], c["kv_lora_rank"], c["n_routed_experts"], c["moe_intermediate_size"], \
        c["intermediate_size"]
    Ih, Dh = c["index_n_heads"], c["index_head_dim"]
    n, k = c["num_hidden_layers"], c.get("num_nextn_predict_layers", 0)
    bf = "BF16"
    t: TensorSpecs = {"model.embed_tokens.weight": (bf, (V, H))}
    for i in range(n + k):
        p = f"model.layers.{i}."
        t.update({
            p + "input_layernorm.weight": (bf, (H,)), p + "post_attention_layernorm.weight": (bf, (H,)),
            p + "self_attn.q_a_proj.weight": (bf, (Iq, H)), p + "self_attn.q_a_layernorm.weight": (bf, (Iq,)),
            p + "self_attn.q_b_proj.weight": (bf, (NH * (Dn + R), Iq)),
            p + "self_attn.kv_a_proj_with_mqa.weight": (bf, (Ikv + R, H)),
            p + "self_attn.kv_a_layernorm.weight": (bf, (Ikv,)),
            p + "self_attn.kv_b_proj.weight": (bf, (NH * (Dn + Dv), Ikv)),
            p + "self_attn.o_proj.weight": (bf, (H, NH * Dv)),
            p + "self_attn.indexer.wq_b.weight": (bf, (Ih * Dh, Iq)), p + "self_attn.indexer.wk.weight": (bf, (Dh, H)),
            p + "self_attn.indexer.k_norm.weight": (bf, (Dh,)), p + "self_attn.indexer.k_norm.bias": (bf, (Dh,)),
            p + "self_attn.indexer.weights_proj.weight": (bf, (Ih, H)),
        })
        if i < c["first_k_dense_replace"]:
            for proj, shape in (("gate_proj", (Id, H)), ("up_proj", (Id, H)), ("down_proj", (H, Id))):
                t[p + f"mlp.{proj}.weight"] = (bf, shape)
        else:
            t[p + "mlp.gate.weight"] = (bf, (E, H))
            t[p + "mlp.gate.e_score_correction_bias"] = ("F32", (E,))
            for e in range(E):
                for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                    t[p + f"mlp.experts.{e}.{proj}.weight"] = (bf, shape)
            S = I * c.get("n_shared_experts", 1)
            for proj, shape in (("gate_proj", (S, H)), ("up_proj", (S, H)), ("down_proj", (H, S))):
                t[p + f"mlp.shared_experts.{proj}.weight"] = (bf, shape)
        if i >= n:
            t.update({p + "enorm.weight": (bf, (H,)), p + "hnorm.weight": (bf, (H,)),
                      p + "eh_proj.weight": (bf, (H, 2 * H)), p + "shared_head.norm.weight": (bf, (H,))})
    t["model.norm.weight"] = (bf, (H,))
    t["lm_head.weight"] = (bf, (V, H))
    return t


MXFP4_SPEC = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "ch_axis": -1, "is_dynamic": False,
              "symmetric": None, "round_method": "half_even", "scale_type": "float", "scale_format": "e8m0",
              "scale_calculation_mode": "even", "mx_element_dtype": None, "observer_cls": "PerBlockMXObserver",
              "is_scale_quant": False}
# amd-quark 0.13's OCP_MXFP8E4M3Spec as the quantizer writes it (quant/pipeline/quark_config.py mxfp8_spec).
MXFP8_SPEC = dict(MXFP4_SPEC, dtype="fp8_e4m3", zero_point_type="int32", block_size=None, enable_buffer_reuse=False,
                  max_input_numel=4194304)
FP8_WEIGHT_SPEC = {"dtype": "fp8_e4m3", "qscheme": "per_channel", "ch_axis": 0, "is_dynamic": False,
                   "group_size": None, "symmetric": None, "round_method": None, "scale_type": None,
                   "scale_format": None, "scale_calculation_mode": None, "mx_element_dtype": None,
                   "observer_cls": "PerChannelMinMaxObserver", "is_scale_quant": False}


def layer_config(scheme: str) -> dict:
    """A Quark QLayerConfig dict: "w_mxfp4_a_mxfp4", "w_mxfp4" (weight-only), "w_mxfp8_a_mxfp8" or "fp8" (PTPC)."""
    if scheme == "fp8":
        weight = dict(FP8_WEIGHT_SPEC)
        act = dict(FP8_WEIGHT_SPEC, qscheme="per_channel", ch_axis=1, is_dynamic=True)
    elif scheme == "w_mxfp8_a_mxfp8":
        weight, act = dict(MXFP8_SPEC), dict(MXFP8_SPEC, is_dynamic=True)
    else:
        weight = dict(MXFP4_SPEC)
        act = dict(MXFP4_SPEC, is_dynamic=True) if scheme == "w_mxfp4_a_mxfp4" else None
    return {"weight": weight, "input_tensors": act, "output_tensors": None, "bias": None, "target_device": None}


def quark_quantization_config(scheme: str, exclude: list[str]) -> dict:
    return {
        "quant_method": "quark", "quant_mode": "eager_mode", "version": "0.11", "algo_config": None,
        "softmax_quant_spec": None, "global_quant_config": layer_config(scheme), "layer_type_quant_config": {},
        "layer_quant_config": {}, "kv_cache_quant_config": {}, "kv_cache_post_rope": False, "exclude": exclude,
        "export": {"kv_cache_group": [], "min_kv_scale": 0.0, "pack_method": "reorder",
                   "weight_format": "real_quantized", "weight_merge_groups": None},
    }


def quantized_tensors(module: str, shape: tuple[int, int], scheme: str) -> TensorSpecs:
    out_f, in_f = shape
    if scheme == "fp8":
        return {f"{module}.weight": ("F8_E4M3", (out_f, in_f)), f"{module}.weight_scale": ("F32", (out_f,))}
    if scheme == "w_mxfp8_a_mxfp8":
        return {f"{module}.weight": ("F8_E4M3", (out_f, in_f)), f"{module}.weight_scale": ("U8", (out_f, in_f // 32))}
    return {f"{module}.weight": ("U8", (out_f, in_f // 2)), f"{module}.weight_scale": ("U8", (out_f, in_f // 32))}


# Modules a careful export keeps in BF16: engines never quantize routers, the indexer's weights_proj (nor, in
# vLLM, its wk: fused with weights_proj into one unquantized GEMM; engine rules), embeddings and heads. The MTP layer stays BF16 except its routed experts: vLLM before PR #46757 cannot
# build a BF16 FusedMoE from per-expert excludes (vllm #48226, ROCm/vllm #1022), so those are quantized like the
# main layers' experts to load on old and new releases alike.
KEEP_BF16 = ("mlp.gate", "indexer.weights_proj", "indexer.wk", "embed_tokens", "lm_head")
_ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")


def keep_bf16_portable(config: dict):
    def keep(module: str) -> bool:
        if module.endswith(KEEP_BF16):
            return True
        return split_mtp(module, config) is not None and not _ROUTED_EXPERT.search(module)
    return keep


def keep_bf16_whole_mtp(config: dict):
    """The GLM-5.2-MXFP4 release layout: the whole MTP layer BF16 (fails vLLM without PR #46757)."""
    def keep(module: str) -> bool:
        return module.endswith(KEEP_BF16) or split_mtp(module, config) is not None
    return keep


def quark_layout(config: dict, bf16: TensorSpecs, scheme: str = "w_mxfp4_a_mxfp4",
                 keep=None) -> tuple[TensorSpecs, dict]:
    """Quantize every 2-D `.weight` whose module `keep(module)` is False (default: `keep_bf16_portable`);
    returns (tensors, config with quantization_config), the exclude list rendered through `exclude_aliases`
    for every kept Linear."""
    keep = keep or keep_bf16_portable(config)
    out: TensorSpecs = {}
    exclude: dict[str, None] = {}
    for name, (dtype, shape) in bf16.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module is None or len(shape) != 2:
            out[name] = (dtype, shape)
        elif keep(module):
            out[name] = (dtype, shape)
            if not module.endswith("embed_tokens"):
                exclude.update(dict.fromkeys(exclude_aliases(module, config)))
        else:
            out.update(quantized_tensors(module, shape, scheme))
    cfg = dict(config, quantization_config=quark_quantization_config(scheme, list(exclude)))
    return out, cfg
