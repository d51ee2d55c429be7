"""NVFP4 sources with no BF16 original (issue #43): ModelOpt's layout (nvidia/*-NVFP4) and compressed-tensors' (the
layout SGLang 0.5.23 reads MiniMax-M3.1-Flash's routed experts in) read from headers, decoded as each reference
decodes it, requantized to MXFP4 with the loss against the released NVFP4 in the
manifest and every block MXFP4 can hold exactly carried over exactly; the release's MXFP8 layers carried over bit for
bit. The decoder and the toy encoder are checked against vLLM's own NVFP4 code in
tests_engines/test_source_formats_reference.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from quant.errors import QuantError
from quant.numerics import mxfp4
from quant.pipeline import quantize_checkpoint
from quant.sources import e2m1_e4m3, registry
from quant.toy import build_toy

DTYPES = {torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32", torch.bfloat16: "BF16"}


class Info:
    def __init__(self, t):
        self.dtype, self.shape = DTYPES[t.dtype], tuple(t.shape)


def headers(parts: dict, module: str = "proj") -> dict:
    return {module + suffix: Info(t) for suffix, t in parts.items()}


def test_modelopt_nvfp4_is_recognised_and_its_global_scale_multiplies():
    w = torch.randn(32, 64)
    parts = registry.encode_as("modelopt-nvfp4", w)
    enc = registry.recognise(headers(parts), "proj.weight")
    assert (enc.kind, enc.shape, enc.block, enc.global_scale) == ("modelopt-nvfp4", (32, 64), (1, 16),
                                                                   "proj.weight_scale_2")
    assert registry.scale_tensors(headers(parts)) == {"proj.weight_scale", "proj.weight_scale_2", "proj.input_scale"}
    values = registry.decode(enc, parts[".weight"], parts[".weight_scale"], global_scale=parts[".weight_scale_2"])
    # ModelOpt's weight_scale_2 is amax / (6 * 448): multiplied, where compressed-tensors divides by its global scale
    block = parts[".weight_scale"].float() * parts[".weight_scale_2"]
    assert torch.equal(values, e2m1_e4m3.unpack_e2m1(parts[".weight"]) * block.repeat_interleave(16, -1))
    assert float((values - w).abs().max()) < float(w.abs().max()) / 4


def test_a_bf16_weight_beside_a_stray_weight_scale_is_not_a_quantized_weight():
    tensors = {"proj.weight": Info(torch.zeros(32, 64, dtype=torch.bfloat16)),
               "proj.weight_scale": Info(torch.zeros(32, 4, dtype=torch.float8_e4m3fn))}
    assert registry.recognise(tensors, "proj.weight") is None
    assert registry.scale_tensors(tensors) == set()


def test_a_missing_modelopt_global_scale_is_named():
    parts = registry.encode_as("modelopt-nvfp4", torch.randn(16, 32))
    del parts[".weight_scale_2"]
    with pytest.raises(QuantError, match="proj.weight_scale_2 is missing"):
        registry.recognise(headers(parts), "proj.weight")


def _nvfp4_exactly_mxfp4(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """Values NVFP4 stores and MXFP4 can hold exactly: per 32-block, E2M1 values times one power of two, with the
    block's amax below the top code (so the recipe's scale rule picks a larger exponent than the exact one)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0])[torch.randint(0, 6, (rows, k), generator=g)]
    signs = torch.where(torch.rand(rows, k, generator=g) < 0.5, -1.0, 1.0)
    exps = torch.randint(-4, 4, (rows, k // 32), generator=g).float().repeat_interleave(32, -1)
    return codes * signs * torch.exp2(exps)


@pytest.mark.parametrize("mode", mxfp4.SCALE_MODES)
def test_every_block_mxfp4_holds_exactly_goes_across_exactly(mode):
    """Whatever the scale mode, a block of NVFP4 values MXFP4 can hold exactly is requantized exactly (the smallest
    exponent that covers its amax is exact for it, and every rule picks it), and the manifest's count says so."""
    x = _nvfp4_exactly_mxfp4(64, 128)
    x[:, 32:64] = torch.randn(64, 32)  # one block column MXFP4 cannot hold exactly
    packed, scales = mxfp4.quantize_mxfp4(x, mode=mode)
    back = mxfp4.dequantize_mxfp4(packed, scales, dtype=torch.float32)
    assert torch.equal(back[:, :32], x[:, :32]) and torch.equal(back[:, 64:], x[:, 64:])
    assert e2m1_e4m3.exact_blocks(x, packed, scales) == (64 * 3, 64 * 4)
    # a scale one step too coarse loses the smallest codes: the count would show it
    assert e2m1_e4m3.exact_blocks(x, packed, (scales.int() + 1).to(torch.uint8))[0] < 64 * 3


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    root = tmp_path_factory.mktemp("m31")
    build_toy("minimax-m3.1-flash", root / "toy")
    return root


def _export(flash, recipe: str):
    out = flash / recipe
    if not out.exists():
        quantize_checkpoint(flash / "toy", out, recipe=recipe, log=lambda m: None)
    return out, json.loads((out / "quant_manifest.json").read_text())


def test_minimax_m31_flash_toy_is_stored_as_sglang_reads_it(flash):
    """The config contract of SGLang 0.5.23's minimax_m3_nvfp4 method (arg_groups/model_overrides/minimax_m3.py:
    18-34, layers/quantization/minimax_m3_nvfp4.py:83-103): MXFP8 [1, 32] projections declared by quant_method mxfp8,
    compressed-tensors NVFP4 routed experts named by moe_quant_algo / moe_quant_format."""
    from safetensors import safe_open

    qc = json.loads((flash / "toy" / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["weight_block_size"], qc["moe_quant_algo"], qc["moe_quant_format"],
            qc["group_size"]) == ("mxfp8", [1, 32], "NVFP4", "nvfp4-pack-quantized", 16)
    assert (qc["kv_cache_quant_algo"], qc["attention_quant_algo"], qc["index_k_quant_type"]) == ("FP8", "FP8", "nvfp4")
    with safe_open(str(flash / "toy" / "model.safetensors"), "pt") as f:
        tensors = {k: Info_of(f.get_slice(k)) for k in f.keys()}
    kinds = {}
    for name in tensors:
        enc = registry.recognise(tensors, name) if name.endswith((".weight", ".weight_packed")) else None
        if enc is not None:
            kinds[enc.module] = enc.kind
    assert {k for m, k in kinds.items() if ".experts." in m} == {"ct-nvfp4"}
    assert {k for m, k in kinds.items() if ".self_attn." in m} == {"mxfp8"}
    assert not any(".shared_experts." in m or ".mlp." in m for m in kinds)
    assert set(qc["ignored_layers"]) >= {m for m in (n.rsplit(".", 1)[0] for n in tensors)
                                         if ".shared_experts." in m and m not in kinds}


class Info_of:
    def __init__(self, sl):
        self.dtype, self.shape = sl.get_dtype(), tuple(sl.get_shape())


def test_the_nvfp4_to_mxfp4_loss_is_in_the_manifest_per_tensor(flash):
    out, manifest = _export(flash, "experts-only")
    experts = {n: r for n, r in manifest["tensors"].items() if r.get("role") == "routed_experts"}
    assert experts and all(r["source_encoding"] == "ct-nvfp4" for r in experts.values())
    assert all(r["action"] == "quantize" and r["rel_mse"] > 0 and 0 <= r["exact_blocks"] < r["blocks"]
               for r in experts.values())
    assert {r["blocks"] for r in experts.values()} == {128 * 160 // 32, 160 * 128 // 32}
    source = load_file(str(flash / "toy" / "model.safetensors"))
    name = next(iter(experts))
    enc = registry.recognise(headers({k[len(name):]: v for k, v in source.items() if k.startswith(name + ".")}, name),
                       f"{name}.weight_packed")
    released = registry.decode(enc, source[f"{name}.weight_packed"], source[f"{name}.weight_scale"],
                         global_scale=source[f"{name}.weight_global_scale"])
    shard = load_file(str(out / "model.safetensors"))
    ours = mxfp4.dequantize_mxfp4(shard[f"{name}.weight"], shard[f"{name}.weight_scale"], dtype=torch.float32)
    d, x = (ours - released).reshape(-1).double(), released.reshape(-1).double()
    # the manifest records 6 significant digits of a float64 sum (the same on every CPU)
    assert experts[name]["rel_mse"] == float(f"{float(d @ d) / float(x @ x):.6g}")


def test_the_mxfp8_layers_are_carried_over_bit_for_bit(flash):
    out, manifest = _export(flash, "experts-mxfp4-rest-mxfp8")
    source = load_file(str(flash / "toy" / "model.safetensors"))
    shard = load_file(str(out / "model.safetensors"))
    carried = [n for n, r in manifest["tensors"].items() if r.get("source_encoding") == "mxfp8"]
    assert carried and all(manifest["tensors"][n]["action"] == "passthrough" for n in carried)
    for module in carried:
        assert torch.equal(shard[f"{module}.weight"].view(torch.uint8), source[f"{module}.weight"].view(torch.uint8))
        assert torch.equal(shard[f"{module}.weight_scale"], source[f"{module}.weight_scale_inv"])
