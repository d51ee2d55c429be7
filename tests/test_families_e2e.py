"""The five families added as data, end to end (issue #23): toy -> quantize (RTN) -> verify-manifest -> in-process
eval, and `--method gptq` solved or refused in one line before OUT exists; MiniMax's declared-but-unpublished MTP
refused in one line. And vLLM's MiniMax-M2 runtime names (engines.yaml vllm.build_prefixes): vLLM builds the
checkpoint's block_sparse_moe.* as model.layers.N.mlp.* (minimax_m2.py prefix=f"{prefix}.mlp"), so the exclude list
carries that form and the preflight fails an export whose exclude has only the checkpoint form."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from quant.checkpoint import open_checkpoint
from quant.errors import QuantError
from quant.gptq.calibration import CalibrationSettings
from quant.gptq.run import GptqSettings
from quant.pipeline import quantize_checkpoint
from quant.verify import verify_checkpoint

pytestmark = pytest.mark.xdist_group("toy")
REPO = Path(__file__).resolve().parents[1]
CALIB = REPO / "evals" / "data" / "toy_arith" / "train.jsonl"
FAST = GptqSettings(CalibrationSettings(str(CALIB), samples=4, seq_len=32), batch=4)
# family -> why GPTQ refuses it (None: it solves); transformers' AutoModelForCausalLM has no class for the
# vision-language wrappers, so the decoder stack cannot be built from config.json
FAMILIES = {"deepseek-v3.2": None, "kimi-k2.5": "Kimi_K25Config", "minimax-m2": None,
            "minimax-m3": "MiniMaxM3VLConfig", "glm4.7": None}
MTP_UNPUBLISHED = {"minimax-m2"}


def _quiet(_message):
    pass


@pytest.mark.parametrize("toy", FAMILIES)
def test_family_chain_toy_quantize_verify_eval_gptq(toy, toy_factory, tmp_path, one_torch_thread):
    from evals.compare import EvalRequest, evaluate

    src = toy_factory(toy)
    rtn = tmp_path / "rtn"
    quantize_checkpoint(src, rtn, recipe="all-linear", log=_quiet)
    assert any(t.dtype == "U8" for t in open_checkpoint(rtn).tensors.values())
    report = verify_checkpoint(rtn, engines=["sglang", "vllm"])
    assert not report.errors, [f.message for f in report.errors]

    def run_eval(out: Path, mtp: bool):
        return evaluate(EvalRequest(candidate=str(rtn), baseline=str(src), tasks="toy_arith", out=out, limit=2,
                                    max_gen_toks=8, batch_size=2, device="cpu", dtype="float32", mtp=mtp),
                        log=_quiet)

    if toy in MTP_UNPUBLISHED:  # the config declares MTP modules the release never published
        with pytest.raises(QuantError, match="publishes no MTP weights") as e:
            run_eval(tmp_path / "eval-mtp", True)
        assert "\n" not in str(e.value) and "--no-mtp" in str(e.value)
    result = run_eval(tmp_path / "eval", toy not in MTP_UNPUBLISHED)
    assert result["rows"] and (tmp_path / "eval" / "report.json").is_file()

    out = tmp_path / "gptq"
    why = FAMILIES[toy]
    if why is None:
        manifest = quantize_checkpoint(src, out, recipe="all-linear", method="gptq", gptq=FAST, log=_quiet)
        methods = [r["method"]["method"] for r in manifest["tensors"].values() if r["action"] == "quantize"]
        assert methods.count("gptq") >= 4, methods
        assert json.loads((out / "config.json").read_text())["quantization_config"] == \
            json.loads((rtn / "config.json").read_text())["quantization_config"]
    else:
        with pytest.raises(QuantError, match=f"--method gptq does not support .*{why}") as e:
            quantize_checkpoint(src, out, recipe="all-linear", method="gptq", gptq=FAST, log=_quiet)
        assert "\n" not in str(e.value) and "--method rtn" in str(e.value)
        assert not out.exists()


def test_minimax_m2_gptq_loads_the_experts_transformers_names_differently(toy_factory):
    """transformers builds MiniMax-M2's block_sparse_moe.experts.E.w1/w3/w2 as mlp.experts.gate_up_proj / down_proj:
    the family's transformers_layer data places each checkpoint tensor in the layer."""
    from quant.gptq.layers import DecoderStack

    src = toy_factory("minimax-m2")
    stack = DecoderStack(src, open_checkpoint(src), ["hidden_states"], "cpu", __import__("torch").float32)
    slot = stack.slot(1, "model.layers.1.block_sparse_moe.experts.3.w3.weight", None, None)
    assert (slot.key, slot.expert, slot.rows) == ("mlp.experts.gate_up_proj", 3, (128, 256))
    assert stack.slot(1, "model.layers.1.block_sparse_moe.experts.3.w2.weight", None, None).key == \
        "mlp.experts.down_proj"
    layer = stack.load_layer(1)
    assert layer.mlp.experts.gate_up_proj.abs().sum() > 0 and layer.mlp.gate.weight.abs().sum() > 0


# ------------------------------------------------------------------------------ vLLM's MiniMax-M2 runtime names


@pytest.fixture(scope="module")
def minimax_kept_layer(toy_factory, tmp_path_factory) -> Path:
    """The minimax-m2 toy with layer 1's routed experts kept BF16 (checked for vLLM 0.32 only: SGLang needs a
    coarse entry and vLLM 0.31 cannot keep a FusedMoE unquantized at all, as for every family)."""
    root = tmp_path_factory.mktemp("minimax-kept")
    recipe = root / "keep.yaml"
    recipe.write_text("base: experts-only\nkeep: ['^model\\.layers\\.1\\.block_sparse_moe\\.experts\\.']\n")
    out = root / "q"
    quantize_checkpoint(toy_factory("minimax-m2"), out, recipe=str(recipe), check_engines=["vllm==0.32"], log=_quiet)
    return out


def test_minimax_exclude_lists_vllm_runtime_names(minimax_kept_layer):
    exclude = json.loads((minimax_kept_layer / "config.json").read_text())["quantization_config"]["exclude"]
    manifest = json.loads((minimax_kept_layer / "quant_manifest.json").read_text())
    for entries in (exclude, manifest["exclude"]):
        for e in range(8):
            for leaf in ("w1", "w2", "w3"):
                assert f"model.layers.1.block_sparse_moe.experts.{e}.{leaf}" in entries  # SGLang, transformers
                assert f"model.layers.1.mlp.experts.{e}.{leaf}" in entries  # vLLM's FusedMoE prefix
    assert not any(e.startswith("model.layers.0.mlp.experts") for e in exclude)  # layer 0 is quantized
    assert not verify_checkpoint(minimax_kept_layer, engines=["vllm==0.32"]).errors


def test_preflight_fails_a_minimax_exclude_in_checkpoint_form_only(minimax_kept_layer, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(minimax_kept_layer, broken)
    config = json.loads((broken / "config.json").read_text())
    q = config["quantization_config"]
    q["exclude"] = [e for e in q["exclude"] if ".mlp." not in e]
    (broken / "config.json").write_text(json.dumps(config, indent=2))
    errors = verify_checkpoint(broken, engines=["vllm==0.32"]).errors
    assert len(errors) == 1, [f.message for f in errors]  # the experts only: vLLM's GateLinear is never quantized
    assert "vLLM builds model.layers.1.mlp.experts (FusedMoE" in errors[0].message
    assert "model.layers.1.mlp.experts.0.w1" in errors[0].fix
    # SGLang builds the checkpoint name (sglang minimax_m2.py prefix=add_prefix("block_sparse_moe", prefix)).
    from quant.engines import build_prefixes, profile

    assert build_prefixes(profile("sglang", "0.5.23").rules, config) == ()


def test_vl_toys_carry_the_release_config(toy_factory):
    """The Kimi-K2.5 and MiniMax-M3 toys' config.json is the release's (what SGLang reads to build them: the
    remote-code architecture name, MoonViT's vt_* sizes, MiniMax-M3's layer plan and CLIP rope keys), with the
    toy's sizes; transformers' own spellings of the MiniMax-M3 layer plan are absent (it maps the release's)."""
    from quant.families.shapes import config_shapes

    kimi = json.loads((toy_factory("kimi-k2.5") / "config.json").read_text())
    assert kimi["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert kimi["text_config"]["architectures"] == ["DeepseekV3ForCausalLM"]
    vision = kimi["vision_config"]
    assert (vision["vt_hidden_size"], vision["vt_num_hidden_layers"], vision["init_pos_emb_height"]) == \
        (vision["hidden_size"], vision["num_hidden_layers"], vision["pos_emb_height"])
    assert vision["text_hidden_size"] == kimi["text_config"]["hidden_size"]

    m3 = json.loads((toy_factory("minimax-m3") / "config.json").read_text())
    text = m3["text_config"]
    assert text["moe_layer_freq"] == [0, 1] and text["sparse_attention_config"]["sparse_attention_freq"] == [0, 1]
    assert not {"layer_types", "mlp_layer_types", "index_n_heads", "index_head_dim"} & set(text)
    assert {"img_token_compression_config", "position_embedding_type", "rope_mode",
            "vision_segment_max_frames"} <= set(m3["vision_config"])
    # the preflight still sizes the indexer, from sparse_attention_config (families/adapters.py)
    assert config_shapes(m3)("language_model.model.layers.1.self_attn.index_q_proj") == (2 * 64, 160)
