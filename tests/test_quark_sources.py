"""A Quark export as a source (issue #43): `quant quantize` reads this tool's and AMD's Quark MXFP4 / MXFP8 / FP8
exports (AMD's MXFP8 with one scale per [32, 32] block included) and writes a recipe from them, carrying each
quantized tensor over bit for bit where the target scheme is the stored one and decoding it exactly otherwise."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from quant.numerics import mxfp8
from quant.pipeline import quantize_checkpoint
from quant.sources import e2m1_e8m0, e4m3_e8m0, quark_mxfp8
from quant.toy import build_toy

RECIPES = ["experts-only", "all-linear", "experts-mxfp4-attn-fp8", "experts-mxfp4-rest-mxfp8"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("quark-sources")
    build_toy("qwen3-moe", root / "toy")
    return root


def _export(src, out, recipe):
    if not out.exists():
        quantize_checkpoint(src, out, recipe=recipe, log=lambda m: None)
    return out, json.loads((out / "quant_manifest.json").read_text())


def _quantized(shard: dict, manifest: dict) -> dict:
    names = {n for r in manifest["tensors"].values() if r.get("scheme") for n in r["outputs"]}
    return {n: shard[n] for n in names}


@pytest.mark.parametrize("recipe", RECIPES)
def test_an_export_quantized_again_to_its_recipe_is_byte_identical(work, recipe):
    first, manifest = _export(work / "toy", work / recipe, recipe)
    again, manifest2 = _export(first, work / f"{recipe}-again", recipe)
    a, b = load_file(str(first / "model.safetensors")), load_file(str(again / "model.safetensors"))
    quantized = _quantized(a, manifest)
    assert quantized and set(a) == set(b)
    for name, t in quantized.items():
        assert b[name].dtype == t.dtype and torch.equal(b[name].view(torch.uint8), t.view(torch.uint8)), name
    actions = {r["action"] for r in manifest2["tensors"].values() if r.get("scheme")}
    assert actions == {"passthrough"}
    encodings = {r["source_encoding"] for r in manifest2["tensors"].values() if r.get("scheme")}
    assert encodings <= {"quark-mxfp4", "quark-mxfp8", "quark-fp8"}
    assert manifest2["exclude"] == manifest["exclude"]


def test_an_export_requantized_to_another_recipe_decodes_exactly(work):
    """The all-linear export's MXFP4 attention, kept by experts-only, becomes BF16 of exactly its decoded values."""
    first, manifest = _export(work / "toy", work / "all-linear", "all-linear")
    narrower, manifest2 = _export(first, work / "all-linear-to-experts-only", "experts-only")
    a, b = load_file(str(first / "model.safetensors")), load_file(str(narrower / "model.safetensors"))
    module = next(n for n, r in manifest["tensors"].items() if r.get("role") == "attention")
    assert manifest2["tensors"][module + ".weight"]["action"] == "dequantize"
    decoded = e2m1_e8m0.decode_mxfp4(a[module + ".weight"], a[module + ".weight_scale"])
    assert torch.equal(b[module + ".weight"], decoded.to(torch.bfloat16))


def test_amds_32x32_mxfp8_spelling_is_carried_over_value_for_value(work):
    """AMD's mixed releases (DeepSeek-V4.1-Flash-MXFP4) store MXFP8 with one E8M0 scale per [32, 32] block,
    `weight_scale` [O/32, I/32]: read as such, and written as [1, 32] MXFP8 with the same codes and every element's
    scale unchanged."""
    first, manifest = _export(work / "toy", work / "experts-mxfp4-rest-mxfp8", "experts-mxfp4-rest-mxfp8")
    amd = work / "amd-blocks"
    amd.mkdir()
    for f in first.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            (amd / f.name).write_bytes(f.read_bytes())
    shard = load_file(str(first / "model.safetensors"))
    source = load_file(str(work / "toy" / "model.safetensors"))
    modules = [n for n, r in manifest["tensors"].items() if r.get("scheme") == "w_mxfp8_a_mxfp8"]
    for module in modules:
        q, s = quark_mxfp8.encode_quark_mxfp8_blocks(source[module + ".weight"].float())
        shard[module + ".weight"], shard[module + ".weight_scale"] = q, s
    save_file(shard, str(amd / "model.safetensors"), metadata={"format": "pt"})
    out, manifest2 = _export(amd, work / "amd-blocks-again", "experts-mxfp4-rest-mxfp8")
    b = load_file(str(out / "model.safetensors"))
    for module in modules:
        record = manifest2["tensors"][module]
        assert (record["action"], record["source_encoding"]) == ("passthrough", "quark-mxfp8")
        assert torch.equal(b[module + ".weight"].view(torch.uint8), shard[module + ".weight"].view(torch.uint8))
        assert tuple(b[module + ".weight_scale"].shape) == tuple(shard[module + ".weight"].shape[:1]) + (
            shard[module + ".weight"].shape[1] // 32,)
        values = e4m3_e8m0.decode_fp8_ue8m0(shard[module + ".weight"], shard[module + ".weight_scale"], 32)
        assert torch.equal(mxfp8.dequantize_mxfp8(b[module + ".weight"], b[module + ".weight_scale"]), values)
