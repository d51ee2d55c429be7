"""The five families added as data, end to end (issue #23): toy -> quantize (RTN and `--method gptq`) ->
verify-manifest -> in-process eval; MiniMax's declared-but-unpublished MTP refused in one line. GPTQ builds the
vision-language wrappers' (Kimi-K2.5, MiniMax-M3) text decoder layers alone, from the text config, with the class
the family data names (transformers_layer.text_model), and places the checkpoint's tensors in them by the family's
renames and fused linears: the layers it runs one at a time compute exactly what transformers' whole model computes,
its exports are byte-identical on 1 and 2 workers, and a wrapper whose family data names no text model is refused in
one line before calibration. And vLLM's MiniMax-M2 runtime names (the engine rules vllm.build_prefixes): vLLM builds the
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
from quant.gptq import GptqSettings
from quant.pipeline import quantize_checkpoint
from quant.verify import verify_checkpoint

pytestmark = pytest.mark.xdist_group("toy")
REPO = Path(__file__).resolve().parents[1]
CALIB = REPO / "evals" / "data" / "toy_arith" / "train.jsonl"
FAST = GptqSettings(CalibrationSettings(str(CALIB), samples=4, seq_len=32), batch=4)
FAMILIES = ["deepseek-v3.2", "kimi-k2.5", "minimax-m2", "minimax-m3", "glm4.7", "qwen4-exp", "glm5-next"]
MTP_UNPUBLISHED = {"minimax-m2"}
# Families whose published MTP block transformers has no layer class for (family data mtp_draft.unsupported): the
# in-process draft is refused in one line.
MTP_UNBUILDABLE = {"glm5-next", "qwen4-exp"}
# Families whose MTP block the in-process draft cannot build (MTP_UNBUILDABLE): GPTQ rounds the MTP layer's weights
# to nearest and records why; every other weight not behind a router is solved.
# The vision-language wrappers: toy -> (family, the wrapper's transformers class, its text model's prefix)
WRAPPERS = {"kimi-k2.5": ("kimi_k25", "Kimi_K25ForConditionalGeneration", "language_model.model."),
            "minimax-m3": ("minimax_m3_vl", "MiniMaxM3SparseForConditionalGeneration", "language_model.model."),
            "glm5-next": ("glm5_next", "Glm5NextForConditionalGeneration", "model.language_model.")}


def _quiet(_message):
    pass


def _layers_one_at_a_time(stack, tokens):
    """What GPTQ's decoder stack computes: the first layer's inputs captured, then every layer loaded and run alone."""
    hidden = stack.capture(tokens, 2)
    carry = [{} for _ in hidden]
    for index in range(len(stack)):
        hidden, carry = stack.forward(index, stack.load_layer(index), hidden, carry)
    return hidden


@pytest.mark.parametrize("toy", FAMILIES)
def test_family_chain_toy_quantize_verify_eval_gptq(toy, toy_factory, tmp_path, one_torch_thread):
    from evals.compare import EvalRequest, evaluate

    src = toy_factory(toy)
    rtn = tmp_path / "rtn"
    quantize_checkpoint(src, rtn, recipe="all-linear", log=_quiet)
    assert any(t.dtype == "U8" for t in open_checkpoint(rtn).tensors.values())
    report = verify_checkpoint(rtn, engines=["sglang", "vllm"])
    assert not report.errors, [f.message for f in report.errors]

    def run_eval(candidate: Path, out: Path, mtp: bool):
        return evaluate(EvalRequest(candidate=str(candidate), baseline=str(src), tasks="toy_arith", out=out, limit=2,
                                    max_gen_toks=8, batch_size=2, device="cpu", dtype="float32", mtp=mtp),
                        log=_quiet).to_json()

    if toy in MTP_UNPUBLISHED:  # the config declares MTP modules the release never published
        with pytest.raises(QuantError, match="publishes no MTP weights") as e:
            run_eval(rtn, tmp_path / "eval-mtp", True)
        assert "\n" not in str(e.value) and "--no-mtp" in str(e.value)
    if toy in MTP_UNBUILDABLE:
        with pytest.raises(QuantError, match="MTP draft cannot be run in process") as e:
            run_eval(rtn, tmp_path / "eval-mtp", True)
        assert "\n" not in str(e.value) and "--no-mtp" in str(e.value)
    with_mtp = toy not in MTP_UNPUBLISHED | MTP_UNBUILDABLE
    result = run_eval(rtn, tmp_path / "eval", with_mtp)
    assert result["rows"] and (tmp_path / "eval" / "report.json").is_file()

    out = tmp_path / "gptq"
    manifest = quantize_checkpoint(src, out, recipe="all-linear", method="gptq", gptq=FAST, log=_quiet)
    methods = [r["method"]["method"] for r in manifest["tensors"].values() if r["action"] == "quantize"]
    assert methods.count("gptq") >= 4, methods
    assert json.loads((out / "config.json").read_text())["quantization_config"] == \
        json.loads((rtn / "config.json").read_text())["quantization_config"]
    report = verify_checkpoint(out, engines=["sglang", "vllm"])
    assert not report.errors, [f.message for f in report.errors]
    # Every weight not behind a router sees every calibration token and is solved; on the calibration inputs
    # GPTQ's output error is no worse than round-to-nearest's, weight by weight, and lower in all.
    solved = {n: r["method"] for n, r in manifest["tensors"].items() if r["action"] == "quantize"}
    text = json.loads((src / "config.json").read_text())
    mtp_layer = f"layers.{text.get('text_config', text)['num_hidden_layers']}."
    for name, method in solved.items():
        if toy in MTP_UNBUILDABLE and (mtp_layer in name or name.startswith("mtp.")):
            assert method["method"] == "rtn" and "no in-process MTP draft" in method["why"], (name, method)
        elif ".experts." not in name:
            assert method["method"] == "gptq", (name, method)
    solved = {n: m for n, m in solved.items() if m["method"] == "gptq"}
    assert all(m["calib_rel_error_gptq"] <= m["calib_rel_error_rtn"] for m in solved.values()), solved
    assert sum(m["calib_rel_error_gptq"] for m in solved.values()) < \
        0.5 * sum(m["calib_rel_error_rtn"] for m in solved.values())
    if toy in WRAPPERS or toy in MTP_UNPUBLISHED:  # the dry run counts every weight the run solves
        from quant.gptq.dry_run import predict

        text = predict(str(src), devices="cpu", recipe="all-linear", settings=FAST).text()
        planned = [n for n, r in manifest["tensors"].items()  # the MTP layer of an unbuildable draft is RTN
                   if r["action"] == "quantize" and not (toy in MTP_UNBUILDABLE and (mtp_layer in n or
                                                                                       n.startswith("mtp.")))]
        assert f"; {len(planned)} weights solved" in text, text
        if toy in MTP_UNBUILDABLE:
            assert "rounded to nearest, not solved: no in-process MTP draft" in text, text
    if toy in WRAPPERS:  # the text model's weights only: the vision tower stays BF16, never calibrated
        prefix = WRAPPERS[toy][2]
        assert solved and all(n.startswith(prefix + "layers.") for n in solved)
        assert all(r["action"] == "copy" for n, r in manifest["tensors"].items() if not n.startswith(prefix))
    result = run_eval(out, tmp_path / "eval-gptq", with_mtp)
    assert result["rows"]


def test_minimax_m2_gptq_loads_the_experts_transformers_names_differently(toy_factory):
    """transformers builds MiniMax-M2's block_sparse_moe.experts.E.w1/w3/w2 as mlp.experts.gate_up_proj / down_proj:
    the family's transformers_layer data places each checkpoint tensor in the layer."""
    from quant.model_exec.layers import DecoderStack

    src = toy_factory("minimax-m2")
    stack = DecoderStack(src, open_checkpoint(src), ["hidden_states"], "cpu", __import__("torch").float32)
    slot = stack.slot(1, "model.layers.1.block_sparse_moe.experts.3.w3.weight", None, None)
    assert (slot.key, slot.expert, slot.rows) == ("mlp.experts.gate_up_proj", 3, (128, 256))
    assert stack.slot(1, "model.layers.1.block_sparse_moe.experts.3.w2.weight", None, None).key == \
        "mlp.experts.down_proj"
    layer = stack.load_layer(1)
    assert layer.mlp.experts.gate_up_proj.abs().sum() > 0 and layer.mlp.gate.weight.abs().sum() > 0


@pytest.mark.parametrize("toy", WRAPPERS)
def test_wrapper_text_layers_one_at_a_time_compute_the_whole_models_hidden_states(toy, toy_factory,
                                                                                   one_torch_thread):
    """GPTQ's decoder stack of a vision-language wrapper: transformers' text model built from text_config alone
    (the vision tower never built), its embedding read from language_model.model.embed_tokens, each layer loaded
    from language_model.model.layers.N.* through the family's renames (MiniMax-M3: block_sparse_moe.*, the
    router's bias, index_*_proj -> self_attn.indexer.*, gate_proj/up_proj rows -> gate_up_proj), gives exactly the
    hidden states of the wrapper's whole model as transformers loads it from the checkpoint."""
    import torch
    import transformers

    from quant.model_exec.layers import DecoderStack

    from quant.families import load_family

    src = toy_factory(toy)
    family, wrapper, prefix = WRAPPERS[toy]
    # what each decoder layer returns (GLM-5.3-Flash's, as GLM-5's, hands its DSA top-k indices to the next)
    stack = DecoderStack(src, open_checkpoint(src), load_family(family).layer_returns, "cpu", torch.float32)
    assert not any("vision" in n for n, _ in stack.text.named_parameters())
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    hidden = _layers_one_at_a_time(stack, tokens)
    with torch.no_grad():
        streams = hidden[0]  # GLM-5.3-Flash carries mHC streams [B, S, hc_mult, H] that its hc_head averages
        ours = stack.text.norm(stack.text.hc_head(streams) if hasattr(stack.text, "hc_head") else streams)
        full = getattr(transformers, wrapper).from_pretrained(src, dtype=torch.float32).eval()
        theirs = full.model.language_model(input_ids=tokens, use_cache=False).last_hidden_state
    assert torch.equal(ours, theirs), float((ours - theirs).abs().max())
    if toy == "minimax-m3":  # the checkpoint's split gate/up rows land in transformers' fused linear
        slot = stack.slot(0, f"{prefix}layers.0.mlp.up_proj.weight", None, None)
        assert (slot.key, slot.expert, slot.rows) == ("mlp.gate_up_proj.weight", None, (256, 512))
        slot = stack.slot(1, f"{prefix}layers.1.block_sparse_moe.shared_experts.gate_proj.weight", None, None)
        assert (slot.key, slot.rows) == ("mlp.shared_experts.gate_up_proj.weight", (0, 128))
        assert stack.slot(1, f"{prefix}layers.1.self_attn.index_q_proj.weight", None, None).key == \
            "self_attn.indexer.q_proj.weight"


@pytest.mark.parametrize("toy", WRAPPERS)
def test_wrapper_gptq_export_is_the_same_on_one_and_two_workers(toy, toy_factory, tmp_path, one_torch_thread):
    src = toy_factory(toy)
    for devices in (["cpu"], ["cpu", "cpu"]):
        quantize_checkpoint(src, tmp_path / str(len(devices)), recipe="all-linear", method="gptq", gptq=FAST,
                            devices=devices, check_engines=None, log=_quiet)
    files = sorted(p.name for p in (tmp_path / "1").glob("*.safetensors"))
    assert files
    for name in files + ["config.json"]:
        assert (tmp_path / "1" / name).read_bytes() == (tmp_path / "2" / name).read_bytes(), name


def test_a_wrapper_without_a_text_model_in_its_family_data_is_refused_before_calibration(toy_factory, tmp_path,
                                                                                          monkeypatch):
    """What still cannot work is one line before any work: a wrapper AutoModelForCausalLM has no model for, whose
    family data names no transformers text model to build its decoder layers with."""
    import quant.families as families
    import quant.gptq.run as run

    load = families.load_family

    def without_text_model(name):
        family = load(name)
        family.transformers_layer["text_model"] = None
        return family

    def no_calibration(*args, **kwargs):
        raise AssertionError("calibration started")

    monkeypatch.setattr(families, "load_family", without_text_model)
    monkeypatch.setattr(run, "calibration_tokens", no_calibration)
    with pytest.raises(QuantError) as e:
        quantize_checkpoint(toy_factory("kimi-k2.5"), tmp_path / "out", recipe="all-linear", method="gptq",
                            gptq=FAST, check_engines=None, log=_quiet)
    message = str(e.value)
    assert message.startswith("--method gptq does not support kimi_k25 checkpoints yet: transformers' "
                              "AutoModelForCausalLM has no model for Kimi_K25Config"), message
    assert "transformers_layer.text_model" in message and "--method rtn" in message and "\n" not in message
    assert not (tmp_path / "out").exists()


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


def test_qwen4_exp_layers_one_at_a_time_compute_the_whole_models_hidden_states(toy_factory, one_torch_thread):
    """GPTQ's decoder stack of Qwen4-Exp (issue #31): the layers it runs one at a time take the hyper-connection
    streams transformers widens the embedding into, with the kwargs the model passes (the PLE token ids among them),
    and read the PLE n-gram table from the checkpoint's row shards (ngram_embedding.shard_{j}.weight, transformers'
    Concatenate(dim=0) converter); through the model's final hyper_connection_mixer they give exactly the hidden
    states of the model transformers loads from the checkpoint. A shard in the wrong place would not."""
    import torch
    import transformers

    from quant.model_exec.layers import DecoderStack, row_shards

    src = toy_factory("qwen4-exp")
    ckpt = open_checkpoint(src)
    table = "model.language_model.layers.0.ple.ple_embedding.ngram_embedding.weight"
    assert len(row_shards(ckpt.tensors, table)) == 4 and table not in ckpt.tensors
    stack = DecoderStack(src, ckpt, ["hidden_states"], "cpu", torch.float32)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    hidden = _layers_one_at_a_time(stack, tokens)
    with torch.no_grad():
        ours = stack.text.hyper_connection_mixer(hidden[0])
        full = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        theirs = full.model(input_ids=tokens, use_cache=False).last_hidden_state
    assert torch.equal(ours, theirs), float((ours - theirs).abs().max())
