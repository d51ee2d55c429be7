"""DeepSeek-V4 (issue #31): a toy stored as the release stores it (MXFP4 experts, UE8M0 block-FP8 attention and
shared experts, `.scale` siblings), and lossless passthrough of its experts through `quant quantize`."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from quant.checkpoint import open_checkpoint
from quant.numerics import mxfp4
from quant.pipeline import quantize_checkpoint

EXPERT = "layers.1.ffn.experts.2.w1"


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(root.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    from quant.toy import build_toy

    src = build_toy("deepseek-v4", tmp_path_factory.mktemp("dsv4") / "ckpt")
    out = tmp_path_factory.mktemp("dsv4-q") / "q"
    manifest = quantize_checkpoint(src, out, check_engines="")  # w_mxfp4_a_mxfp4
    return src, out, manifest


def test_toy_stores_the_release_dtypes(v4):
    src, _, _ = v4
    info = open_checkpoint(src).tensors
    config = json.loads((src / "config.json").read_text())
    assert config["model_type"] == "deepseek_v4" and config["num_nextn_predict_layers"] == 1
    assert config["quantization_config"]["scale_fmt"] == "ue8m0"
    assert (info[EXPERT + ".weight"].dtype, info[EXPERT + ".scale"].dtype) == ("I8", "F8_E8M0")
    assert info[EXPERT + ".weight"].shape[-1] * 2 == info[EXPERT + ".scale"].shape[-1] * 32
    for name in ("layers.0.attn.wq_a", "layers.1.attn.wo_b", "layers.0.ffn.shared_experts.w2", "mtp.0.e_proj"):
        assert (info[name + ".weight"].dtype, info[name + ".scale"].dtype) == ("F8_E4M3", "F8_E8M0"), name
    assert {info[n].dtype for n in ("embed.weight", "head.weight", "layers.0.ffn.gate.weight",
                                    "layers.0.attn_norm.weight", "norm.weight")} == {"BF16"}
    assert {info[n].dtype for n in ("layers.0.hc_attn_fn", "hc_head_fn", "layers.1.attn.attn_sink")} == {"F32"}
    assert any(n.startswith("mtp.0.ffn.experts.") for n in info)


def test_experts_pass_through_bit_for_bit(v4):
    src, out, manifest = v4
    source, export = _tensors(src), _tensors(out)
    experts = [n[: -len(".weight")] for n in source if ".ffn.experts." in n and n.endswith(".weight")]
    assert len(experts) == 3 * 4 * 3  # 2 layers + the MTP block, 4 experts, w1/w2/w3
    changed_by_requantize = 0
    for module in experts:
        codes, scales = source[module + ".weight"], source[module + ".scale"]
        assert torch.equal(export[module + ".weight"], codes.view(torch.uint8)), module
        assert torch.equal(export[module + ".weight_scale"], scales.view(torch.uint8)), module
        record = manifest["tensors"][module]
        assert record["action"] == "passthrough" and record["scheme"] == "w_mxfp4_a_mxfp4", record
        # What a decode-and-requantize tool would have written instead (our RTN on the exact values):
        values = mxfp4.dequantize_mxfp4(codes.view(torch.uint8), scales.view(torch.uint8), dtype=torch.float32)
        packed, requantized = mxfp4.quantize_mxfp4(values, mode="even")
        changed_by_requantize += not (torch.equal(packed, codes.view(torch.uint8))
                                      and torch.equal(requantized, scales.view(torch.uint8)))
    assert changed_by_requantize == len(experts), "the toy must be one our RTN would not reproduce"


def test_other_tensors_are_decoded_exactly_once(v4):
    """FP8 attention kept BF16 equals ml_dtypes' decode (exact: E4M3 x 2^k fits BF16); shared experts quantized
    to MXFP4 from the exact decode; plain tensors copied."""
    src, out, manifest = v4
    source, export = _tensors(src), _tensors(out)
    name = "layers.1.attn.wq_b"
    q = source[name + ".weight"].view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    s = source[name + ".scale"].view(torch.uint8).numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    want = q * np.repeat(np.repeat(s, 128, 0), 128, 1)[: q.shape[0], : q.shape[1]]
    assert export[name + ".weight"].dtype == torch.bfloat16
    np.testing.assert_array_equal(export[name + ".weight"].float().numpy(), want)
    assert manifest["tensors"][name + ".weight"]["action"] == "dequantize"
    shared = "layers.0.ffn.shared_experts.w1"
    assert manifest["tensors"][shared]["action"] == "quantize"
    q = source[shared + ".weight"].view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    s = source[shared + ".scale"].view(torch.uint8).numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    exact = torch.from_numpy(q * np.repeat(np.repeat(s, 128, 0), 128, 1)[: q.shape[0], : q.shape[1]])
    packed, scales = mxfp4.quantize_mxfp4(exact, mode="even")
    assert torch.equal(export[shared + ".weight"], packed) and torch.equal(export[shared + ".weight_scale"], scales)
    assert not any(n.endswith(".scale") for n in export)
    assert torch.equal(export["layers.0.hc_attn_fn"], source["layers.0.hc_attn_fn"])


def test_toy_help_lists_every_toy():
    from typer.testing import CliRunner

    from quant.cli import app
    from quant.toy import TOY_NAMES

    result = CliRunner().invoke(app, ["toy", "--help"], env={"COLUMNS": "400", "NO_COLOR": "1"})
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert all(name in text for name in TOY_NAMES) and "deepseek-v4" in TOY_NAMES


def test_the_toy_is_its_family_and_roles_cover_the_release_names(v4):
    from quant.families import family_for_config

    src, _, _ = v4
    family = family_for_config(open_checkpoint(src).config)
    assert family.name == "deepseek_v4"
    roles = {m: family.role_of(m) for m in ("layers.0.ffn.experts.3.w2", "mtp.0.ffn.experts.0.w1",
                                            "layers.1.ffn.shared_experts.w3", "layers.0.attn.wo_a", "embed", "head",
                                            "layers.0.ffn.gate", "mtp.0.e_proj", "layers.1.attn.indexer.wq_b")}
    assert roles == {"layers.0.ffn.experts.3.w2": "routed_experts", "mtp.0.ffn.experts.0.w1": "routed_experts",
                     "layers.1.ffn.shared_experts.w3": "shared_experts", "layers.0.attn.wo_a": "attention",
                     "embed": "keep", "head": "keep", "layers.0.ffn.gate": "keep", "mtp.0.e_proj": "keep",
                     "layers.1.attn.indexer.wq_b": "indexer"}


def test_verify_manifest_on_the_passthrough_export(v4):
    """The preflight reads the export like any Quark MXFP4 checkpoint: no shape or scale finding on the carried-over
    experts, and none on the MTP layer, which both engines' drafts read from mtp.{k}.* (the engine rules mtp_namespace
    DeepseekV4ForCausalLM), not model.layers.{N+k}.* (before: a false vLLM "MTP ... weights missing" error and an
    SGLang warning on model.layers.2.*)."""
    from quant.verify import verify_checkpoint
    from quant.verify.scales import scan_scales

    _, out, _ = v4
    assert scan_scales(out) == []
    report = verify_checkpoint(out, engines=["sglang", "vllm"])
    assert report.findings == []


def test_a_v4_export_without_its_mtp_layer_is_flagged_at_mtp_0(v4, tmp_path):
    """The same export with its mtp.0.* tensors dropped: vLLM's DeepSeekV4MTP raises (layer N+0 = 2 missing), SGLang
    builds its draft with nothing to load; both name the tensors the loaders read, mtp.0.*."""
    import shutil

    from safetensors.torch import save_file

    from quant.verify import verify_checkpoint

    _, out, _ = v4
    ckpt = tmp_path / "no-mtp"
    shutil.copytree(out, ckpt)
    tensors = {k: v for k, v in _tensors(ckpt).items() if not k.startswith("mtp.")}
    for f in ckpt.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: "model.safetensors" for k in tensors}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    mtp = [f for f in verify_checkpoint(ckpt, engines=["sglang", "vllm"]).findings if f.rule == "mtp layer missing"]
    assert {(f.engine, f.severity, f.tensor) for f in mtp} == {("vllm", "error", "mtp.0.*"),
                                                              ("sglang", "warning", "mtp.0.*")}
    assert "MTP speculative decoding layer 2 weights missing" in [f for f in mtp if f.engine == "vllm"][0].message


def test_exclude_names_the_mtp_layer_as_each_draft_builds_it(v4):
    """The MTP layer's BF16 modules are listed in exclude under the checkpoint's name (SGLang 0.5.23 maps it) and
    under the names the drafts that match exclude unmapped build them: vLLM's model.layers.{N+k}.* and SGLang
    0.5.12's model.decoder.* / model.e_proj."""
    _, out, _ = v4
    exclude = json.loads((out / "config.json").read_text())["quantization_config"]["exclude"]
    for name in ("mtp.0.attn.wq_a", "model.layers.2.attn.wq_a", "model.decoder.self_attn.wq_a",
                 "mtp.0.e_proj", "model.layers.2.e_proj", "model.e_proj"):
        assert name in exclude, name
    assert not [e for e in exclude if e.startswith("model.layers.") and not e.startswith("model.layers.2.")]


def test_draft_names_of_the_v4_mtp_layer():
    from quant import engines

    config = {"architectures": ["DeepseekV4ForCausalLM"], "num_hidden_layers": 61, "num_nextn_predict_layers": 2}
    vllm = engines.mtp_namespace(engines.profile("vllm", "0.32").rules, config)
    assert engines.namespace_draft_name(vllm, "mtp.1.ffn.shared_experts.w2", config) == \
        "model.layers.62.ffn.shared_experts.down_proj"
    assert engines.namespace_layers(vllm, config) == [(61, "mtp.0."), (62, "mtp.1.")]
    old, new = (engines.mtp_namespace(engines.profile("sglang", r).rules, config) for r in ("0.5.12", "0.5.23"))
    assert engines.namespace_draft_name(old, "mtp.0.ffn.experts.3.w1", config) == "model.decoder.mlp.experts.3.gate_proj"
    assert (old.maps_exclude, new.maps_exclude) == (False, True)
    assert engines.mtp_namespace(engines.profile("vllm", "0.32").rules, {"architectures": ["DeepseekV3ForCausalLM"]}) \
        is None


def test_ue8m0_fp8_attention_passes_through_into_block_fp8(v4, tmp_path):
    """fp8-block target: UE8M0 128x128 attention keeps its E4M3 codes, its scales become the exact F32 powers
    of two; the MXFP4 experts (another format) are decoded once and quantized."""
    src, _, _ = v4
    out = tmp_path / "fp8"
    manifest = quantize_checkpoint(src, out, scheme="fp8-block", recipe="all-linear", check_engines="",
                                   log=lambda m: None)
    source, export = _tensors(src), _tensors(out)
    name = "layers.1.attn.wq_b"
    assert manifest["tensors"][name]["action"] == "passthrough"
    assert torch.equal(export[name + ".weight"].view(torch.uint8), source[name + ".weight"].view(torch.uint8))
    want = source[name + ".scale"].view(torch.uint8).numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    np.testing.assert_array_equal(export[name + ".weight_scale_inv"].numpy(), want)
    assert manifest["tensors"][EXPERT]["action"] == "quantize"


def test_an_export_naming_the_mtp_layer_only_as_stored_fails_the_drafts_that_match_exclude_unmapped(v4, tmp_path):
    """Another tool's export: its MTP layer's BF16 modules excluded under the checkpoint's mtp.0.* names only.
    vLLM's draft (and SGLang 0.5.12's) matches exclude against the names it builds (model.layers.2.*,
    model.decoder.*), finds none and builds those modules quantized over BF16 tensors; SGLang 0.5.23 maps exclude
    with the same renames and loads it."""
    import shutil

    from quant.verify import verify_checkpoint

    _, out, _ = v4
    ckpt = tmp_path / "checkpoint-names"
    shutil.copytree(out, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    q = config["quantization_config"]
    q["exclude"] = [e for e in q["exclude"] if not e.startswith(("model.layers.2.", "model.decoder.", "model.e_proj",
                                                                   "model.h_proj"))]
    (ckpt / "config.json").write_text(json.dumps(config, indent=2))
    assert verify_checkpoint(ckpt, engines=["sglang==0.5.23"]).errors == []
    vllm = verify_checkpoint(ckpt, engines=["vllm==0.32"]).errors
    assert vllm and all(f.tensor.startswith("mtp.0.") and "builds model.layers.2." in f.message for f in vllm), \
        [(f.tensor, f.message) for f in vllm]
    assert any(f.fix == "add model.layers.2.e_proj to exclude" for f in vllm)
