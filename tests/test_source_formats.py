"""Source formats beyond DeepSeek-V4's (issue #31): MiniMax-M3's MXFP8 ([1, 32] E8M0 `weight_scale_inv`), DeepSeek-V4.1's
UE8M0 32x32 FP8, compressed-tensors MXFP4 (Kimi-K3's `mxfp4-pack-quantized`) and NVFP4 (`nvfp4-pack-quantized`).

The decoders are checked against bit-exact vectors written once by each format's own reference code
(tests/data/source_formats, made by scripts/source_format_vectors.py in the engines venv: compressed-tensors 0.17's
compressors, vLLM 0.32's MXFP8 quantizer/dequantizer and DeepSeek-V4.1 scale loader; vectors.json records the
versions); tests_engines/test_source_formats_reference.py checks them against those packages on fresh data. Then a
toy in each release format goes through `quant quantize`: passthrough where the target is the source's own format
(bytes identical, where a requantize would have changed them), one exact decode elsewhere, an export the preflight
passes and transformers loads."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from quant.errors import QuantError
from quant.numerics import mxfp4, mxfp8
from quant.sources import e2m1_e4m3, e4m3_e8m0, registry
from quant.sources import native
from quant.sources.source_format import Encoding

pytestmark = pytest.mark.xdist_group("toy")

DATA = Path(__file__).parent / "data" / "source_formats"


@dataclass
class Info:
    dtype: str
    shape: tuple


DTYPES = {torch.uint8: "U8", torch.int8: "I8", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e8m0fnu: "F8_E8M0",
          torch.float32: "F32", torch.bfloat16: "BF16", torch.int32: "I32"}


def headers(tensors: dict[str, torch.Tensor]) -> dict[str, Info]:
    return {k: Info(DTYPES[v.dtype], tuple(v.shape)) for k, v in tensors.items()}


@pytest.fixture(scope="module")
def vectors() -> dict[str, torch.Tensor]:
    return load_file(DATA / "vectors.safetensors")


def group(vectors, prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) + 1:]: v for k, v in vectors.items() if k.startswith(prefix + ".")}


def assert_same(ours: torch.Tensor, reference: torch.Tensor) -> None:
    """Our fp32 decode equals the reference's output bit for bit in the reference's dtype (bf16 here: the
    references decode to bf16), and, where that dtype holds every value exactly, in fp32 too."""
    assert ours.dtype == torch.float32
    assert torch.equal(ours.to(reference.dtype).view(torch.int16), reference.view(torch.int16))


def test_vectors_record_their_producers():
    meta = json.loads((DATA / "vectors.json").read_text())
    assert meta["generated_by"] == "scripts/source_format_vectors.py"
    assert meta["compressed_tensors"] and meta["vllm"]
    assert meta["quantization_config"]["ct_mxfp4"]["format"] == "mxfp4-pack-quantized"
    assert meta["quantization_config"]["ct_nvfp4"]["format"] == "nvfp4-pack-quantized"


@pytest.mark.parametrize("prefix", ["ct_mxfp4", "ct_mxfp4_bytes"])
def test_ct_mxfp4_decodes_as_compressed_tensors_decompresses(vectors, prefix):
    tensors = group(vectors, prefix)
    codes = tensors["proj.weight_packed"]
    enc = registry.recognise(headers(tensors), "proj.weight_packed")
    logical = (codes.shape[0], codes.shape[1] * 2)
    assert enc == Encoding("ct-mxfp4", "proj.weight_scale", (1, 32), logical, "proj")
    ours = registry.decode(enc, codes, tensors["proj.weight_scale"])
    reference = tensors["decoded"]
    assert_same(ours, reference)
    assert torch.equal(ours, reference.float())  # E2M1 x 2^k is exact in bf16


@pytest.mark.parametrize("prefix", ["ct_nvfp4", "ct_nvfp4_bytes"])
def test_ct_nvfp4_decodes_as_compressed_tensors_decompresses(vectors, prefix):
    tensors = group(vectors, prefix)
    enc = registry.recognise(headers(tensors), "proj.weight_packed")
    assert (enc.kind, enc.block, enc.global_scale) == ("ct-nvfp4", (1, 16), "proj.weight_global_scale")
    ours = registry.decode(enc, tensors["proj.weight_packed"], tensors["proj.weight_scale"],
                     global_scale=tensors["proj.weight_global_scale"])
    assert_same(ours, tensors["decoded"])


@pytest.mark.parametrize("prefix", ["mxfp8", "mxfp8_bytes"])
def test_mxfp8_decodes_as_vllm_dequantizes(vectors, prefix):
    tensors = {"x.weight": vectors[prefix + ".weight"], "x.weight_scale_inv": vectors[prefix + ".weight_scale_inv"]}
    enc = registry.recognise(headers(tensors), "x.weight")
    assert (enc.kind, enc.block, enc.module) == ("mxfp8", (1, 32), "x")
    ours = registry.decode(enc, tensors["x.weight"], tensors["x.weight_scale_inv"])
    assert_same(ours, vectors[prefix + ".decoded"])
    assert torch.equal(ours, vectors[prefix + ".decoded"].float())
    # Quark MXFP8 carries the same bytes: decoded by quant.numerics (what dequant and the engines read), the same.
    parts = e4m3_e8m0.to_quark_mxfp8(tensors["x.weight"], tensors["x.weight_scale_inv"], enc.block)
    assert torch.equal(parts["weight"].view(torch.uint8), tensors["x.weight"].view(torch.uint8))
    assert torch.equal(parts["weight_scale"], tensors["x.weight_scale_inv"])


def test_ue8m0_32x32_fp8_decodes_as_vllms_deepseek_v41_loader(vectors):
    tensors = {"x.weight": vectors["ue8m0_32.weight"], "x.scale": vectors["ue8m0_32.scale"]}
    enc = registry.recognise(headers(tensors), "x.weight")
    assert (enc.kind, enc.block) == ("fp8-ue8m0", (32, 32))
    ours = registry.decode(enc, tensors["x.weight"], tensors["x.scale"])
    reference = vectors["ue8m0_32.decoded"]
    assert torch.equal(ours, reference.float())
    # Repacked into Quark MXFP8 [1, 32] (the layout vLLM's loader builds): the same codes, the same values.
    parts = e4m3_e8m0.to_quark_mxfp8(tensors["x.weight"], tensors["x.scale"], enc.block)
    assert parts["weight_scale"].shape == (64, 3)
    assert torch.equal(mxfp8.dequantize_mxfp8(parts["weight"], parts["weight_scale"]), reference.float())


def test_the_compressed_tensors_configs_are_accepted_and_other_formats_refused(tmp_path):
    meta = json.loads((DATA / "vectors.json").read_text())
    for qc in meta["quantization_config"].values():
        native.check_config(qc, tmp_path / "config.json")
    int4 = json.loads(json.dumps(meta["quantization_config"]["ct_mxfp4"]))
    int4["format"] = int4["config_groups"]["group_0"]["format"] = "pack-quantized"
    with pytest.raises(QuantError, match=r"config.json: quantization_config format pack-quantized is not supported"):
        native.check_config(int4, tmp_path / "config.json")


def test_headers_that_fit_no_format_are_refused_naming_the_tensors():
    def rec(t, name):
        return registry.recognise({k: Info(*v) for k, v in t.items()}, name, "shard.safetensors")

    with pytest.raises(QuantError, match="shard.safetensors: m.weight_packed is NVFP4 but m.weight_global_scale is missing"):
        rec({"m.weight_packed": ("U8", (32, 32)), "m.weight_scale": ("F8_E4M3", (32, 4))}, "m.weight_packed")
    with pytest.raises(QuantError, match="integer pack-quantized sources are not supported"):
        rec({"m.weight_packed": ("I32", (32, 8)), "m.weight_scale": ("BF16", (32, 2))}, "m.weight_packed")
    with pytest.raises(QuantError, match=r"m.weight_scale \[32, 3\] matches no ct-mxfp4 block size"):
        rec({"m.weight_packed": ("U8", (32, 32)), "m.weight_scale": ("U8", (32, 3))}, "m.weight_packed")
    with pytest.raises(QuantError, match=r"m.weight_scale_inv \[32, 3\] matches no mxfp8 block size"):
        rec({"m.weight": ("F8_E4M3", (32, 64)), "m.weight_scale_inv": ("U8", (32, 3))}, "m.weight")
    with pytest.raises(QuantError, match="zero-point"):
        rec({"m.weight_packed": ("U8", (32, 32)), "m.weight_scale": ("U8", (32, 2)),
             "m.weight_zero_point": ("U8", (32, 2))}, "m.weight_packed")
    # MXFP8 in [32, 32] blocks under MiniMax's names (the DeepSeek-V4.1 block): one scale row per 32 rows.
    assert rec({"m.weight": ("F8_E4M3", (96, 64)), "m.weight_scale_inv": ("F8_E8M0", (3, 2))}, "m.weight") == \
        Encoding("mxfp8", "m.weight_scale_inv", (32, 32), (96, 64), "m")
    # Official block FP8 (F32 weight_scale_inv) is not a microscaled format: left to the block-FP8 path.
    block = {"m.weight": Info("F8_E4M3", (160, 96)), "m.weight_scale_inv": Info("F32", (2, 1))}
    assert registry.recognise(block, "m.weight") is None and registry.scale_tensors(block) == set()
    nv = {"m.weight_packed": Info("U8", (32, 32)), "m.weight_scale": Info("F8_E4M3", (32, 4)),
          "m.weight_global_scale": Info("F32", (1,)), "m.input_global_scale": Info("F32", (1,))}
    assert registry.scale_tensors(nv) == {"m.weight_scale", "m.weight_global_scale", "m.input_global_scale"}


# ------------------------------------------------------------------------------------------- toys through quantize

def _tensors(root: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(root.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _export(src: Path, out: Path, **kwargs) -> dict:
    from quant.pipeline import quantize_checkpoint

    return quantize_checkpoint(src, out, check_engines="", log=lambda m: None, **kwargs)


@pytest.fixture(scope="module")
def toys(tmp_path_factory) -> dict[str, Path]:
    from quant.toy import build_toy

    root = tmp_path_factory.mktemp("source-formats")
    return {fmt: build_toy(toy, root / fmt, source_format=fmt)
            for fmt, toy in (("mxfp8", "minimax-m3"), ("ct-mxfp4", "kimi-k2.5"), ("ct-nvfp4", "qwen3-moe"))}


def test_toys_store_the_release_formats(toys):
    from quant.checkpoint import open_checkpoint

    mx8 = open_checkpoint(toys["mxfp8"])
    q = mx8.config["quantization_config"]
    assert (q["quant_method"], q["weight_block_size"]) == ("mxfp8", [1, 32])
    name = "language_model.model.layers.0.self_attn.q_proj"
    assert (mx8.tensors[name + ".weight"].dtype, mx8.tensors[name + ".weight_scale_inv"].dtype) == ("F8_E4M3", "U8")
    assert "language_model.model.layers.1.block_sparse_moe.gate" in q["ignored_layers"]
    ct = open_checkpoint(toys["ct-mxfp4"])
    q = ct.config["quantization_config"]
    assert (q["quant_method"], q["format"], q["quantization_status"]) == ("compressed-tensors",
                                                                       "mxfp4-pack-quantized", "compressed")
    expert = "language_model.model.layers.1.mlp.experts.3.down_proj"
    assert (ct.tensors[expert + ".weight_packed"].dtype, ct.tensors[expert + ".weight_scale"].dtype) == ("U8", "U8")
    assert expert + ".weight" not in ct.tensors
    assert "language_model.model.layers.1.self_attn.q_a_proj" in q["ignore"]  # Kimi-K3: routed experts only
    nv = open_checkpoint(toys["ct-nvfp4"])
    assert nv.tensors["model.layers.0.self_attn.q_proj.weight_global_scale"].dtype == "F32"


def test_ct_mxfp4_experts_pass_through_bit_for_bit(toys, tmp_path):
    src = toys["ct-mxfp4"]
    manifest = _export(src, tmp_path / "q")  # w_mxfp4_a_mxfp4, experts-only
    source, export = _tensors(src), _tensors(tmp_path / "q")
    experts = sorted(n[: -len(".weight_packed")] for n in source if n.endswith(".weight_packed"))
    assert len(experts) == 8 * 3
    changed = 0
    for module in experts:
        codes, scales = source[module + ".weight_packed"], source[module + ".weight_scale"]
        assert torch.equal(export[module + ".weight"], codes) and torch.equal(export[module + ".weight_scale"], scales)
        record = manifest["tensors"][module]
        assert (record["action"], record["source_encoding"]) == ("passthrough", "ct-mxfp4"), record
        values = mxfp4.dequantize_mxfp4(codes, scales, dtype=torch.float32)
        packed, requantized = mxfp4.quantize_mxfp4(values, mode="even")
        changed += not (torch.equal(packed, codes) and torch.equal(requantized, scales))
    assert changed == len(experts), "a requantize must have changed every expert, or the test could not fail"
    assert not any(n.endswith((".weight_packed", ".weight_scale_inv")) for n in export)


def test_mxfp8_passes_through_into_quark_mxfp8(toys, tmp_path):
    src = toys["mxfp8"]
    manifest = _export(src, tmp_path / "q", scheme="w_mxfp8_a_mxfp8", recipe="all-linear")
    source, export = _tensors(src), _tensors(tmp_path / "q")
    modules = sorted(n[: -len(".weight_scale_inv")] for n in source if n.endswith(".weight_scale_inv"))
    assert len(modules) == 40
    changed = 0
    for module in modules:
        q, s = source[module + ".weight"], source[module + ".weight_scale_inv"]
        assert torch.equal(export[module + ".weight"].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(export[module + ".weight_scale"], s)
        assert manifest["tensors"][module]["action"] == "passthrough"
        requantized_q, requantized_s = mxfp8.quantize_mxfp8(mxfp8.dequantize_mxfp8(q, s), "even")
        changed += not torch.equal(requantized_s, s)
    assert changed == len(modules), "MiniMax-M3's ceil rule: our even rule picks another exponent somewhere in each"


def test_ct_nvfp4_is_decoded_once_then_quantized(toys, tmp_path):
    src = toys["ct-nvfp4"]
    manifest = _export(src, tmp_path / "q")
    source, export = _tensors(src), _tensors(tmp_path / "q")
    module = "model.layers.1.mlp.experts.2.gate_proj"
    exact = e2m1_e4m3.decode_nvfp4(source[module + ".weight_packed"], source[module + ".weight_scale"],
                            source[module + ".weight_global_scale"])
    packed, scales = mxfp4.quantize_mxfp4(exact, mode="even")
    assert torch.equal(export[module + ".weight"], packed) and torch.equal(export[module + ".weight_scale"], scales)
    assert manifest["tensors"][module]["action"] == "quantize"
    kept = "model.layers.0.self_attn.q_proj"  # experts-only: attention kept, as its exact decode in BF16
    assert torch.equal(export[kept + ".weight"], e2m1_e4m3.decode_nvfp4(
        source[kept + ".weight_packed"], source[kept + ".weight_scale"],
        source[kept + ".weight_global_scale"]).to(torch.bfloat16))
    assert not any(n.endswith(("_global_scale", ".weight_packed")) for n in export)


def test_deepseek_v4_ue8m0_attention_passes_through_into_mxfp8(tmp_path):
    """The mixed recipe (MXFP4 experts, MXFP8 elsewhere) on DeepSeek-V4: UE8M0 128x128 attention keeps its E4M3 codes,
    each block's scale written for the [1, 32] groups it covers, the values unchanged."""
    from quant.toy import build_toy

    src = build_toy("deepseek-v4", tmp_path / "v4")
    manifest = _export(src, tmp_path / "q", recipe="experts-mxfp4-rest-mxfp8")
    source, export = _tensors(src), _tensors(tmp_path / "q")
    name = "layers.1.attn.wq_b"
    record = manifest["tensors"][name]
    assert (record["action"], record["scheme"], record["source_encoding"]) == ("passthrough", "w_mxfp8_a_mxfp8",
                                                                              "fp8-ue8m0")
    assert torch.equal(export[name + ".weight"].view(torch.uint8), source[name + ".weight"].view(torch.uint8))
    exact = e4m3_e8m0.decode_fp8_ue8m0(source[name + ".weight"], source[name + ".scale"], 128)
    assert torch.equal(mxfp8.dequantize_mxfp8(export[name + ".weight"], export[name + ".weight_scale"]), exact)


@pytest.mark.parametrize("fmt", ["mxfp8", "ct-mxfp4", "ct-nvfp4"])
def test_exports_pass_the_preflight_and_load_in_transformers(toys, tmp_path, fmt):
    from test_transformers_load import strict_load

    from quant.dequant import dequantize_checkpoint
    from quant.verify import verify_checkpoint

    out = tmp_path / "q"
    _export(toys[fmt], out)
    # (a default release that cannot read the model type is only named: MiniMax-M3 in SGLang 0.5.12)
    assert [f for f in verify_checkpoint(out, engines=["sglang", "vllm"]).findings
            if f.rule != "default releases"] == []
    plain = dequantize_checkpoint(out, tmp_path / "plain")
    assert strict_load(plain) == {"missing": [], "unexpected": [], "mismatched": []}


def test_mxfp8_export_passes_the_preflight_of_the_vllm_that_loads_mxfp8_experts(toys, tmp_path):
    from quant.verify import verify_checkpoint

    out = tmp_path / "q"
    _export(toys["mxfp8"], out, scheme="w_mxfp8_a_mxfp8", recipe="all-linear")
    assert verify_checkpoint(out, engines=["vllm==0.33"]).findings == []
    assert verify_checkpoint(out, engines=["vllm==0.32"]).errors  # MXFP8 experts: vLLM 0.33 only (schemes.py)


def test_a_broken_source_is_one_line_naming_file_and_tensor(toys, tmp_path):
    """A ct-mxfp4 source whose expert scale lost a column, and one with a 0xFF (NaN) E8M0 scale: `quant quantize`
    says so in one line naming the shard and tensor, exit 2 (QuantError), no traceback."""
    import shutil

    from safetensors.torch import save_file

    quant = [sys.executable, "-m", "quant.cli"]
    module = "language_model.model.layers.1.mlp.experts.0.up_proj"
    for case, edit in (("shape", lambda t: t[:, :-1].clone()), ("nan", lambda t: t.clone().fill_(255))):
        src = tmp_path / case
        shutil.copytree(toys["ct-mxfp4"], src)
        tensors = _tensors(src)
        tensors[module + ".weight_scale"] = edit(tensors[module + ".weight_scale"])
        save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
        proc = subprocess.run(quant + ["quantize", str(src), str(tmp_path / f"q-{case}"), "--no-progress"],
                              capture_output=True, text=True)
        err = proc.stderr.strip()
        assert proc.returncode == 2 and "Traceback" not in err, err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "model.safetensors" in lines[0] and module in lines[0], err
        assert ("matches no ct-mxfp4 block size" if case == "shape" else "0xFF") in lines[0], lines[0]


def test_toy_refuses_an_unknown_source_format(tmp_path):
    from quant.toy import build_toy

    with pytest.raises(QuantError, match="unknown source format 'nvfp8'; valid names: mxfp8, ct-mxfp4, ct-nvfp4"):
        build_toy("qwen3-moe", tmp_path / "t", source_format="nvfp8")
    assert not (tmp_path / "t").exists()


def test_gptq_refuses_a_microscaled_source_in_one_line(toys):
    """GPTQ's layer reader takes BF16 or block FP8: a microscaled source is refused before any work, saying why
    (before: 'its tensors are named differently', about a family GPTQ does run)."""
    from quant.checkpoint import open_checkpoint
    from quant.model_exec.layers import meta_model

    for fmt in ("ct-nvfp4", "mxfp8"):
        with pytest.raises(QuantError, match="its weights arrive microscaled .* round to nearest"):
            meta_model(toys[fmt], open_checkpoint(toys[fmt]))


def test_a_sharded_nvfp4_source_reads_scales_from_other_shards(tmp_path):
    """Shards split a module's weight_packed, weight_scale and weight_global_scale apart: each job names every file
    it reads (planning/needs.py streams a Hub source by them), and the export holds the one-shard source's tensors."""
    from quant.checkpoint import open_checkpoint
    from quant.families import family_for_config
    from quant.planning.needs import job_files
    from quant.planning.plan import make_plan
    from quant.planning.recipes import load_recipe
    from quant.planning.schemes import SCHEMES
    from quant.toy import build_toy

    whole = build_toy("qwen3-moe", tmp_path / "whole", source_format="ct-nvfp4")
    sharded = build_toy("qwen3-moe", tmp_path / "sharded", source_format="ct-nvfp4", shard_size="16KB")
    ckpt = open_checkpoint(sharded)
    family = family_for_config(ckpt.config)
    plan = make_plan(ckpt, family, load_recipe("experts-only", family), SCHEMES["w_mxfp4_a_mxfp4"], "even")
    split = [j.source for s in plan.shards for j in s.jobs
             if isinstance(j.source, native.NativeSource) and j.source.global_scale_file != j.source.file]
    assert split and all({s.file, s.scale_file, s.global_scale_file} <= job_files(s) for s in split)
    _export(sharded, tmp_path / "q-sharded")
    _export(whole, tmp_path / "q-whole")
    a, b = _tensors(tmp_path / "q-sharded"), _tensors(tmp_path / "q-whole")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_deepseek_v41_storage_passes_through_into_the_mixed_layout(tmp_path):
    """DeepSeek-V4.1-Flash's storage (MXFP4 experts, UE8M0 32x32 FP8 elsewhere) into AMD's mixed layout (MXFP4 experts,
    MXFP8 elsewhere): both carried over, the 32x32 scales written per [1, 32] group (vLLM's own repack), every
    value unchanged; the fp8-block target, whose 128x128 blocks are not the source's, decodes them once."""
    from quant.toy import build_toy
    from quant.verify import verify_checkpoint

    src = build_toy("deepseek-v3", tmp_path / "v41", source_format="deepseek-v4.1")
    manifest = _export(src, tmp_path / "q", recipe="experts-mxfp4-rest-mxfp8")
    source, export = _tensors(src), _tensors(tmp_path / "q")
    expert, attn = "model.layers.1.mlp.experts.5.down_proj", "model.layers.1.self_attn.q_b_proj"
    assert torch.equal(export[expert + ".weight"], source[expert + ".weight"].view(torch.uint8))
    assert torch.equal(export[expert + ".weight_scale"], source[expert + ".scale"].view(torch.uint8))
    assert source[attn + ".scale"].shape == (12, 4)  # [384/32, 128/32]
    assert torch.equal(export[attn + ".weight"].view(torch.uint8), source[attn + ".weight"].view(torch.uint8))
    exact = e4m3_e8m0.decode_fp8_ue8m0(source[attn + ".weight"], source[attn + ".scale"], 32)
    assert torch.equal(mxfp8.dequantize_mxfp8(export[attn + ".weight"], export[attn + ".weight_scale"]), exact)
    assert {(manifest["tensors"][m]["action"], manifest["tensors"][m]["source_encoding"]) for m in (expert, attn)} \
        == {("passthrough", "mxfp4"), ("passthrough", "fp8-ue8m0")}
    assert verify_checkpoint(tmp_path / "q", engines=["vllm==0.33"]).findings == []
    block = _export(src, tmp_path / "fp8", scheme="fp8-block", recipe="all-linear")
    assert block["tensors"][attn]["action"] == "quantize"
