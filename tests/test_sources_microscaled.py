"""quant.sources' native MXFP4 and UE8M0 block-FP8 formats (through the registry): decoded exactly, checked against
an independent reference (ml_dtypes' float4_e2m1fn / float8_e4m3fn / float8_e8m0fnu), not the project's encoder."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest
import torch

from quant.errors import QuantError
from quant.numerics import mxfp4
from quant.sources import e2m1_e8m0, e4m3_e8m0, fp8_ue8m0, registry
from quant.sources import mxfp4 as native_mxfp4
from quant.sources.source_format import Encoding


def ref_e2m1(nibbles: np.ndarray) -> np.ndarray:
    return nibbles.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def ref_e8m0(scale_bytes: np.ndarray) -> np.ndarray:
    return scale_bytes.astype(np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)


def ref_mxfp4(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Element 2i in the low nibble of byte i (torch float4_e2m1fn_x2, transformers' _unpack_fp4)."""
    b = codes.view(np.uint8)
    pairs = np.stack([ref_e2m1(b & 0xF), ref_e2m1(b >> 4)], axis=-1).reshape(*b.shape[:-1], b.shape[-1] * 2)
    return pairs * np.repeat(ref_e8m0(scales.view(np.uint8)), 32, axis=-1)


def ref_fp8(q: np.ndarray, scales: np.ndarray, block: int) -> np.ndarray:
    o, i = q.shape
    values = q.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    full = np.repeat(np.repeat(ref_e8m0(scales.view(np.uint8)), block, 0), block, 1)[:o, :i]
    return values * full


def test_mxfp4_decodes_every_byte_and_scale_exactly():
    g = torch.Generator().manual_seed(0)
    codes = torch.arange(256, dtype=torch.int32).repeat(40).view(80, 128).to(torch.uint8).view(torch.int8)
    scales = torch.randint(90, 165, (80, 8), generator=g, dtype=torch.int32).to(torch.uint8)
    scales[0, 0], scales[1, 1] = 0, 254  # extremes of E8M0 that stay finite for small codes
    codes[1, 16:32] = 0x21  # only values <= 1 under the 2^127 scale
    got = e2m1_e8m0.decode_mxfp4(codes, scales.view(torch.float8_e8m0fnu))
    want = ref_mxfp4(codes.numpy(), scales.numpy())
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), want)


def test_mxfp4_refuses_nan_scales():
    with pytest.raises(QuantError, match="0xFF"):
        e2m1_e8m0.decode_mxfp4(torch.zeros(1, 16, dtype=torch.int8), torch.full((1, 1), 255, dtype=torch.uint8))


@pytest.mark.parametrize("block", [128, 32])
@pytest.mark.parametrize("shape", [(160, 96), (256, 128), (33, 40)])
def test_fp8_ue8m0_decodes_exactly(block, shape):
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(shape, generator=g) * 100).to(torch.float8_e4m3fn)
    s_shape = (-(-shape[0] // block), -(-shape[1] // block))
    scales = torch.randint(100, 150, s_shape, generator=g, dtype=torch.int32).to(torch.uint8)
    got = e4m3_e8m0.decode_fp8_ue8m0(q, scales.view(torch.float8_e8m0fnu), block)
    np.testing.assert_array_equal(got.numpy(), ref_fp8(q.view(torch.uint8).numpy(), scales.numpy(), block))


@dataclass
class Info:
    dtype: str
    shape: tuple


def test_recognise_from_headers():
    t = {"e.weight": Info("I8", (128, 80)), "e.scale": Info("F8_E8M0", (128, 5)),
         "a.weight": Info("F8_E4M3", (160, 96)), "a.scale": Info("F8_E8M0", (2, 1)),
         "d.weight": Info("F8_E4M3", (160, 96)), "d.scale": Info("F8_E8M0", (5, 3)),
         "n.weight": Info("BF16", (160,)),
         "bad.weight": Info("I8", (128, 80)), "bad.scale": Info("F8_E8M0", (128, 4)),
         "f32.weight": Info("I8", (128, 80)), "f32.scale": Info("F32", (128, 5))}
    assert registry.recognise(t, "e.weight") == Encoding("mxfp4", "e.scale", (1, 32), (128, 160), "e")
    assert registry.recognise(t, "a.weight") == Encoding("fp8-ue8m0", "a.scale", (128, 128), (160, 96), "a")
    assert registry.recognise(t, "d.weight") == Encoding("fp8-ue8m0", "d.scale", (32, 32), (160, 96), "d")
    assert registry.recognise(t, "n.weight") is None
    with pytest.raises(QuantError, match="not MXFP4"):
        registry.recognise(t, "bad.weight")
    with pytest.raises(QuantError, match="E8M0"):
        registry.recognise(t, "f32.weight")
    assert registry.scale_tensors(t) == {"e.scale", "a.scale", "d.scale", "bad.scale", "f32.scale"}


def test_quark_parts_are_the_same_bytes_in_the_same_nibble_order():
    """Quark's uint8 weight / weight_scale decode (with quant/numerics' own dequantizer, even element in the low
    nibble) to exactly the values the native tensors hold per ml_dtypes: the repack changes dtype, not bits."""
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(-128, 128, (64, 48), generator=g, dtype=torch.int8)
    scales = torch.randint(110, 140, (64, 3), generator=g, dtype=torch.int32).to(torch.uint8)
    parts = e2m1_e8m0.to_quark_mxfp4(codes, scales.view(torch.float8_e8m0fnu))
    assert parts["weight"].dtype == parts["weight_scale"].dtype == torch.uint8
    assert torch.equal(parts["weight"].view(torch.int8), codes) and torch.equal(parts["weight_scale"], scales)
    quark = mxfp4.dequantize_mxfp4(parts["weight"], parts["weight_scale"], dtype=torch.float32)
    np.testing.assert_array_equal(quark.numpy(), ref_mxfp4(codes.numpy(), scales.numpy()))


def test_release_encoders_round_trip_and_differ_from_our_rtn():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 160, generator=g).to(torch.bfloat16)
    codes, scales = native_mxfp4.encode_mxfp4_release(x)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float8_e8m0fnu
    decoded = e2m1_e8m0.decode_mxfp4(codes, scales)
    np.testing.assert_array_equal(decoded.numpy(), ref_mxfp4(codes.numpy(), scales.view(torch.uint8).numpy()))
    # The release's rule is not ours: requantizing the exact values changes the bytes.
    for mode in mxfp4.SCALE_MODES:
        packed, ours = mxfp4.quantize_mxfp4(decoded, mode=mode)
        assert not torch.equal(ours, scales.view(torch.uint8)), mode
    q, s = fp8_ue8m0.encode_fp8_ue8m0(x.float(), 128)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (1, 2)
    back = e4m3_e8m0.decode_fp8_ue8m0(q, s, 128)
    assert float((back - x.float()).abs().max()) <= float(x.float().abs().max()) / 8
