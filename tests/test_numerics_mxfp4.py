"""MXFP4 numerics: bit-exact against the shared test vectors and against an independent numpy + ml_dtypes reference
on millions of values; error bounds, idempotence, batching, compiled == eager, input errors."""

import math
import zlib

import ml_dtypes
import numpy as np
import pytest
from conftest import load_vectors
import torch

from quant.errors import QuantError
from quant.numerics import mxfp4
from quant.numerics.mxfp4 import dequantize_mxfp4, quantize_mxfp4

MODES = ("floor", "rceil", "even")  # the modes the shared vectors cover




VECTORS = load_vectors("mxfp4_vectors").MXFP4_VECTORS


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------------------------------------------
# Independent reference: exponent from math/np.frexp, elements from ml_dtypes' float4_e2m1fn cast (RNE, saturating).
# ---------------------------------------------------------------------------------------------------------------

def ref_exponents(x: np.ndarray, mode: str) -> np.ndarray:
    """Shared exponent per block of x (float32 [N, 32]) by the textbook formulas."""
    amax = np.abs(x.astype(np.float64)).max(axis=1)
    mant, ex = np.frexp(amax)  # amax = mant * 2^ex, mant in [0.5, 1)
    floor_log2 = ex - 1
    if mode == "floor":
        e = floor_log2 - 2
    elif mode == "even":  # round amax to 2 significant bits (ties up) before taking floor(log2)
        e = floor_log2 - 2 + (2 * mant >= 1.75)
    elif mode == "rceil":  # ceil(log2(amax / 6)); amax / 6 is exact enough in fp64 to place powers of two
        m6, ex6 = np.frexp(amax / 6.0)
        e = np.where(m6 == 0.5, ex6 - 1, ex6)
    else:
        raise ValueError(mode)
    e = np.where(amax == 0, -127, e)
    return np.clip(e, -127, 127).astype(np.int64)


def ref_codes(x: np.ndarray, e: np.ndarray) -> np.ndarray:
    """E2M1 codes (uint8 [N, 32]) of x / 2^e: RNE via ml_dtypes, saturated to +-6, sign kept."""
    y = np.ldexp(x.astype(np.float64), -e[:, None])
    return np.clip(y, -6.0, 6.0).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)


def ref_values(codes: np.ndarray) -> np.ndarray:
    return codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)


def ref_search_exponents(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Brute force over floor, floor+1, floor-1: (exponent chosen by the documented rule, exact fp64 errors [N, 3]).

    The rule: per element d = y - q in fp32 (y = x / 2^e, q its E2M1 value), d*d rounded to fp32, times
    2^(14 + 2 (e - floor)), truncated; summed per block; first strictly smallest in the order floor, +1, -1.
    """
    f = ref_exponents(x, "floor")
    cands = [f, np.clip(f + 1, -127, 126), np.clip(f - 1, -127, 126)]
    units, exact = [], []
    for e in cands:
        q = ref_values(ref_codes(x, e))
        d = np.ldexp(x, -e[:, None]).astype(np.float32) - q.astype(np.float32)
        scale = np.ldexp(np.float32(1), 14 + 2 * (e - f)).astype(np.float32)[:, None]
        units.append(np.floor((d * d) * scale).astype(np.float64).sum(axis=1))
        exact.append(((x.astype(np.float64) - np.ldexp(q, e[:, None])) ** 2).sum(axis=1))
    best = cands[0].copy()
    best_units = units[0].copy()
    for e, u in zip(cands[1:], units[1:]):
        better = u < best_units
        best, best_units = np.where(better, e, best), np.where(better, u, best_units)
    return best, np.stack(exact, axis=1)


def pack(codes: np.ndarray) -> np.ndarray:
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def quantize_np(x: np.ndarray, mode: str, dtype=torch.float32):
    """Our quantizer on float32 numpy blocks [N, 32] -> (packed [N, 16], bytes [N]) as numpy."""
    p, s = quantize_mxfp4(torch.from_numpy(x).to(dtype), mode, compiled=False)
    return p.numpy(), s.numpy().astype(np.int64).reshape(-1)


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------

def blocks(kind: str, n: int, seed: int) -> np.ndarray:
    """n blocks of 32 float32 values of one distribution."""
    rng = np.random.default_rng(seed)
    shape = (n, 32)
    if kind == "normal":
        x = rng.normal(0, 0.02, shape)
    elif kind == "laplace":
        x = rng.laplace(0, 0.01, shape)
    elif kind == "student_t":
        x = rng.standard_t(3, shape) * 0.01
    elif kind == "ties":  # E2M1 midpoints and grid points, exactly, at random block scales, plus 1-ulp neighbours
        grid = np.array([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 6.5, 5.5])
        x = rng.choice(grid, shape) * rng.choice([-1, 1], shape)
        x[:, 0] = rng.choice([4.0, 6.0, 7.0, 7.5])  # amax sets the floor/even/rceil exponent in interesting ways
        x = x.astype(np.float32)
        toward = np.where(rng.random(shape) < 0.5, np.float32(np.inf), np.float32(-np.inf))
        x = np.where(rng.random(shape) < 0.3, np.nextafter(x, toward), x)
        x = x.astype(np.float64) * np.ldexp(1.0, rng.integers(-20, 20, (n, 1)))
    elif kind == "wide":  # per-block scales from fp32-subnormal to near fp32 max, plus zero and -0 blocks
        x = rng.normal(0, 1, shape) * np.ldexp(1.0, rng.integers(-150, 126, (n, 1)))
        x[: n // 64] = 0.0
        x[n // 64: n // 32] = -0.0
        x[n // 32: n // 16] *= rng.random((n // 32, 32)) < 0.1  # sparse blocks
    else:
        raise ValueError(kind)
    return np.nan_to_num(x.astype(np.float32), posinf=0.0, neginf=0.0)


DISTRIBUTIONS = ("normal", "laplace", "student_t", "ties", "wide")


def _seed(*names: str) -> int:
    return zlib.crc32("/".join(names).encode())


# ---------------------------------------------------------------------------------------------------------------
# Shared vectors
# ---------------------------------------------------------------------------------------------------------------

def _vector_inputs(vec):
    """fp32 always; bf16 too when every value is exactly representable (that exercises the bf16 fast kernel)."""
    x = torch.tensor(vec["x"], dtype=torch.float32).view(1, 32)
    yield torch.float32, x
    b = x.to(torch.bfloat16)
    if torch.equal(b.float(), x) and not torch.isnan(x).any():
        yield torch.bfloat16, b


@pytest.mark.parametrize("vec", VECTORS, ids=[v["name"] for v in VECTORS])
@pytest.mark.parametrize("mode", MODES)
def test_shared_vectors_bit_exact(vec, mode):
    scale_byte, packed = vec[mode]
    for dtype, x in _vector_inputs(vec):
        if scale_byte == 0xFF:  # NaN block: we raise instead of writing a NaN scale
            with pytest.raises(QuantError, match=r"\b8 non-finite"):
                quantize_mxfp4(x, mode)
            continue
        p, s = quantize_mxfp4(x, mode, compiled=False)
        assert s.tolist() == [[scale_byte]], (dtype, hex(s.item()))
        assert p.view(-1).tolist() == packed, dtype


@pytest.mark.parametrize("vec", [v for v in VECTORS if "ggml_floor" in v], ids=lambda v: v["name"])
def test_shared_vectors_ggml_layout(vec):
    """Our codes re-laid out as ggml block_mxfp4 (qs[j] = code[j] | code[j+16] << 4) match the vector file."""
    p, s = quantize_mxfp4(torch.tensor(vec["x"]).view(1, 32), "floor")
    codes = torch.stack((p & 0xF, p >> 4), dim=-1).view(32)
    ggml = [s.item()] + (codes[:16] | (codes[16:] << 4)).tolist()
    assert ggml == vec["ggml_floor"]


def test_shared_vectors_against_reference():
    """The reference used by the property tests reproduces the shared vectors too (so it is a fair judge)."""
    for vec in VECTORS:
        x = np.array([vec["x"]], dtype=np.float32)
        if np.isnan(x).any():
            continue
        for mode in MODES:
            e = ref_exponents(x, mode)
            assert [int(e[0]) + 127, pack(ref_codes(x, e))[0].tolist()] == [vec[mode][0], vec[mode][1]]


# ---------------------------------------------------------------------------------------------------------------
# Properties against the independent reference
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", DISTRIBUTIONS)
@pytest.mark.parametrize("mode", MODES)
def test_matches_reference(kind, mode):
    x = blocks(kind, 1 << 14, seed=_seed(kind, mode))  # 0.5 M values per case, 7.9 M in all
    e = ref_exponents(x, mode)
    expected_packed = pack(ref_codes(x, e))
    packed, scales = quantize_np(x, mode)
    np.testing.assert_array_equal(scales, e + 127)
    np.testing.assert_array_equal(packed, expected_packed)


@pytest.mark.parametrize("kind", DISTRIBUTIONS)
@pytest.mark.parametrize("mode", MODES)
def test_bf16_fast_kernel_matches_reference(kind, mode):
    """bf16 input takes the packed-pair kernel (plus the re-encode of tiny blocks): same answer as the reference."""
    x = blocks(kind, 1 << 13, seed=_seed(kind, mode, "bf16"))
    xb = torch.from_numpy(x).to(torch.bfloat16)
    x = xb.float().numpy()
    e = ref_exponents(x, mode)
    packed, scales = quantize_np(x, mode, dtype=torch.bfloat16)
    np.testing.assert_array_equal(scales, e + 127)
    np.testing.assert_array_equal(packed, pack(ref_codes(x, e)))


def test_bf16_tiny_blocks_are_exact():
    """Blocks whose scale is below 2^-124 with bf16-subnormal elements (the fast kernel's blind spot)."""
    rng = np.random.default_rng(3)
    x = (rng.normal(0, 1, (512, 32)) * np.ldexp(1.0, rng.integers(-136, -118, (512, 1)))).astype(np.float32)
    x = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    for mode in MODES:
        e = ref_exponents(x, mode)
        assert (e <= -125).sum() > 50
        packed, scales = quantize_np(x, mode, dtype=torch.bfloat16)
        np.testing.assert_array_equal(scales, e + 127)
        np.testing.assert_array_equal(packed, pack(ref_codes(x, e)))


@pytest.mark.parametrize("kind", DISTRIBUTIONS)
def test_search_matches_brute_force(kind):
    x = blocks(kind, 1 << 12, seed=11 + DISTRIBUTIONS.index(kind))
    best, exact = ref_search_exponents(x)
    packed, scales = quantize_np(x, "search")
    np.testing.assert_array_equal(scales, best + 127)
    np.testing.assert_array_equal(packed, pack(ref_codes(x, best)))
    # Against exact fp64 errors: never worse than the best candidate by more than the 2^-14 unit resolution.
    f = ref_exponents(x, "floor")
    chosen = np.choose(np.select([best == f, best == np.clip(f + 1, -127, 126)], [0, 1], 2), exact.T)
    slack = 32 * np.ldexp(1.0, 2 * f - 14) + 1e-6 * exact.min(axis=1)
    assert np.all(chosen <= exact.min(axis=1) + slack)
    if kind in ("normal", "laplace", "student_t"):
        assert (best != f).mean() > 0.05  # the search does move scales


def test_code_values():
    codes = torch.arange(16)
    expected = torch.tensor(mxfp4.E2M1_VALUES + tuple(-v for v in mxfp4.E2M1_VALUES))
    assert torch.equal(mxfp4.e2m1_values(codes), expected) and torch.signbit(mxfp4.e2m1_values(codes))[8:].all()
    ml = torch.from_numpy(codes.numpy().astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32))
    assert torch.equal(mxfp4.e2m1_values(codes), ml)


def test_rounding_rule_as_code_and_as_value_agree():
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0])
    y = torch.cat([mids, torch.nextafter(mids, torch.zeros(8)), torch.nextafter(mids, torch.full((8,), 9.0)),
                   torch.linspace(0, 15.9, 100_001), torch.tensor([0.0, 2.0**-149, 6.0, 8.0, 15.99])])
    lut = torch.tensor(mxfp4.E2M1_VALUES)
    assert torch.equal(mxfp4.e2m1_round(y), lut[mxfp4.e2m1_code(y).long()])
    ref = torch.from_numpy(np.clip(y.numpy(), 0, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8).astype(np.int32))
    assert torch.equal(mxfp4.e2m1_code(y), ref)


def test_search_ties_prefer_floor_then_larger_scale():
    grid = np.array([[4.0, 2.0, 1.0, 0.0] * 8], dtype=np.float32)  # exact at floor and at floor+1 scales
    p, s = quantize_np(grid, "search")
    assert s[0] == ref_exponents(grid, "floor")[0] + 127
    zeros = np.zeros((1, 32), np.float32)
    assert quantize_np(zeros, "search")[1][0] == 0


# ---------------------------------------------------------------------------------------------------------------
# Error bounds, idempotence, batching
# ---------------------------------------------------------------------------------------------------------------

def _rel_mse(x, mode):
    t = torch.from_numpy(x)
    d = dequantize_mxfp4(*quantize_mxfp4(t, mode, compiled=False), dtype=torch.float32)
    return float(((d - t).double() ** 2).sum() / (t.double() ** 2).sum())


def test_gaussian_relative_mse():
    x = np.random.default_rng(0).normal(0, 1, (1 << 14, 32)).astype(np.float32)  # 0.5 M values
    mse = {mode: _rel_mse(x, mode) for mode in mxfp4.SCALE_MODES}
    assert 0.0120 < mse["even"] < 0.0130  # EVEN on Gaussian blocks: 1.252%
    assert 0.0127 < mse["floor"] < 0.0137  # 1.320%
    assert mse["search"] <= mse["even"] <= mse["floor"]


@pytest.mark.parametrize("mode", mxfp4.SCALE_MODES)
def test_elementwise_error_bound(mode):
    x = np.concatenate([blocks(k, 1 << 11, seed=5) for k in DISTRIBUTIONS])
    t = torch.from_numpy(x)
    packed, scales = quantize_mxfp4(t, mode, compiled=False)
    scale = mxfp4.scale_values(scales).double().repeat_interleave(32, dim=-1)
    y = t.double().abs() / scale  # magnitude in scale units
    step = torch.where(y < 2, 0.5, torch.where(y < 4, 1.0, 2.0))
    err = (dequantize_mxfp4(packed, scales, torch.float32).double() - t.double()).abs() / scale
    clipped = y > 6
    assert torch.all(err[~clipped] <= step[~clipped] / 2)
    assert torch.equal(err[clipped], y[clipped] - 6)
    if mode == "rceil":
        assert not clipped.any()


@pytest.mark.parametrize("mode", mxfp4.SCALE_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_quantize_idempotent(mode, dtype):
    x = torch.from_numpy(np.concatenate([blocks(k, 1 << 9, seed=9) for k in DISTRIBUTIONS])).to(dtype)
    once = dequantize_mxfp4(*quantize_mxfp4(x, mode, compiled=False), dtype=torch.float32)
    twice = dequantize_mxfp4(*quantize_mxfp4(once, mode, compiled=False), dtype=torch.float32)
    assert torch.equal(once, twice)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_batched_equals_per_matrix(dtype):
    x = (torch.randn(3, 40, 96, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)
    for mode in mxfp4.SCALE_MODES:
        p, s = quantize_mxfp4(x, mode)
        assert p.shape == (3, 40, 48) and s.shape == (3, 40, 3)
        assert p.dtype == s.dtype == torch.uint8
        for i in range(3):
            pi, si = quantize_mxfp4(x[i], mode)
            assert torch.equal(p[i], pi) and torch.equal(s[i], si)
        assert dequantize_mxfp4(p, s).shape == x.shape


def test_fp16_and_noncontiguous_inputs():
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    half = x.half()
    assert all(torch.equal(a, b) for a, b in zip(quantize_mxfp4(half), quantize_mxfp4(half.float())))
    t = x.t().contiguous().t()  # same values, column-major
    assert all(torch.equal(a, b) for a, b in zip(quantize_mxfp4(t), quantize_mxfp4(x)))


def test_many_chunks_equal_one_call(monkeypatch):
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x[3, :64] = 0  # zero blocks and tiny blocks in some chunks
    x[100, 32:64] = 1e-38
    whole = quantize_mxfp4(x, compiled=False)
    deq = dequantize_mxfp4(*whole, compiled=False)
    monkeypatch.setattr(mxfp4, "_EAGER_CHUNK_BLOCKS", 7)
    chunked = quantize_mxfp4(x, compiled=False)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))
    assert torch.equal(dequantize_mxfp4(*whole, compiled=False), deq)


# ---------------------------------------------------------------------------------------------------------------
# Dequantization, edge cases, errors
# ---------------------------------------------------------------------------------------------------------------

def test_dequantize_exact_values():
    packed = torch.tensor([[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 2], dtype=torch.uint8)
    values = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6] * 2, dtype=torch.float64)
    for byte in (127, 0, 1, 130, 254):  # byte 254 = 2^127: codes >= 2.0 overflow fp32 to inf
        d = dequantize_mxfp4(packed, torch.tensor([[byte]], dtype=torch.uint8), torch.float32)
        assert torch.equal(d.view(-1), (values * 2.0 ** (byte - 127)).float())
    one_at_byte0 = dequantize_mxfp4(torch.tensor([[2] + [0] * 15], dtype=torch.uint8),
                                    torch.tensor([[0]], dtype=torch.uint8), torch.float32)
    assert one_at_byte0[0, 0].view(torch.int32).item() == 0x00400000  # 2^-127, an fp32 subnormal
    assert torch.isnan(dequantize_mxfp4(packed, torch.tensor([[255]], dtype=torch.uint8))).all()
    assert torch.signbit(dequantize_mxfp4(packed, torch.tensor([[127]], dtype=torch.uint8))[0, 8])  # -0
    bf16 = dequantize_mxfp4(packed, torch.tensor([[120]], dtype=torch.uint8))
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16.double().view(-1), values * 2.0**-7)


def test_extreme_blocks_scale_bytes():
    big = torch.full((1, 32), torch.finfo(torch.float32).max)
    assert [quantize_mxfp4(big, m)[1].item() for m in ("floor", "rceil", "even")] == [0xFC, 0xFD, 0xFD]
    tiny = torch.full((1, 32), 2.0**-140)
    assert all(quantize_mxfp4(tiny, m)[1].item() == 0 for m in mxfp4.SCALE_MODES)
    zero = torch.zeros(2, 64, dtype=torch.bfloat16)
    zero[1] = -0.0
    p, s = quantize_mxfp4(zero)
    assert s.eq(0).all() and p[0].eq(0).all() and p[1].eq(0x88).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_input_raises_with_count(dtype):
    x = torch.randn(4, 64).to(dtype)
    x[0, 3] = float("nan")
    x[2, 40] = float("inf")
    x[3, 63] = -float("inf")
    for mode in mxfp4.SCALE_MODES:
        with pytest.raises(QuantError, match=r"\b3 non-finite"):
            quantize_mxfp4(x, mode)


def test_bad_input_raises():
    with pytest.raises(QuantError, match="multiple of 32"):
        quantize_mxfp4(torch.randn(4, 48))
    with pytest.raises(QuantError, match="bf16/fp16/fp32"):
        quantize_mxfp4(torch.randn(4, 64, dtype=torch.float64))
    with pytest.raises(QuantError, match="scale mode"):
        quantize_mxfp4(torch.randn(4, 64), "ceil")
    with pytest.raises(QuantError, match="does not match"):
        dequantize_mxfp4(torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 3, dtype=torch.uint8))
    p, s = quantize_mxfp4(torch.zeros(0, 64))
    assert p.shape == (0, 32) and s.shape == (0, 2)


# ---------------------------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.xdist_group("compile")
def test_compiled_equals_eager():
    """Every compiled kernel gives the eager kernel's bits. Compiling costs seconds per kernel and input dtype, so
    each kernel is compiled once: the bf16 kernels for floor/even/rceil, the generic ones through fp32 search."""
    parts = [blocks(k, 1 << 10, seed=21) for k in DISTRIBUTIONS]
    x = torch.from_numpy(np.concatenate(parts)).view(-1, 256)
    x[0, 5] = -0.0
    tiny = torch.from_numpy(blocks("wide", 64, seed=1)).view(-1, 256) * 2.0**-100
    cases = [(t, mode) for t in (x.to(torch.bfloat16), torch.cat([x[:64], tiny]).to(torch.bfloat16))
             for mode in ("floor", "even", "rceil")] + [(x, "search")]
    for t, mode in cases:
        eager = quantize_mxfp4(t, mode, compiled=False)
        compiled = quantize_mxfp4(t, mode, compiled=True)
        assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1]), (t.dtype, mode)
        deq = [dequantize_mxfp4(*eager, compiled=c) for c in (False, True)]
        assert torch.equal(deq[0], deq[1])
    assert not any(k.broken for k in (mxfp4.SCALES, mxfp4.CODES, mxfp4.SEARCH_SCALES, mxfp4.BF16_SCALES,
                                      mxfp4.BF16_CODES, mxfp4.DEQUANTIZE))
    with pytest.raises(QuantError, match=r"\b1 non-finite"):
        quantize_mxfp4(torch.where(x == x.max(), math.nan, x).to(torch.bfloat16), compiled=True)


def test_compile_failure_falls_back_to_eager(monkeypatch, caplog):
    from quant.numerics import _compile

    def no_compiler(fn, **kwargs):
        def run(*args):
            raise RuntimeError("C++ compile error: no compiler")
        return run

    monkeypatch.setattr(torch, "compile", no_compiler)
    monkeypatch.setattr(_compile.Kernel, "any_broken", False)
    kernel = _compile.Kernel(lambda t: t + 1)
    assert torch.equal(kernel(torch.ones(3), compiled=True), torch.full((3,), 2.0))
    assert kernel.broken and "using the eager kernel" in caplog.text
    assert not _compile.wants_compiled(1 << 30)  # callers then size their chunks for eager kernels
    assert torch.equal(kernel(torch.ones(3), compiled=True), torch.full((3,), 2.0))


def test_compile_switches(monkeypatch):
    from quant.numerics import _compile

    monkeypatch.setattr(_compile.Kernel, "any_broken", False)
    assert _compile.wants_compiled(_compile.COMPILE_MIN_ELEMENTS) and not _compile.wants_compiled(1000)
    assert _compile.wants_compiled(1000, compiled=True) and not _compile.wants_compiled(1 << 30, compiled=False)
    monkeypatch.setenv("QUANT_NO_COMPILE", "1")
    assert not _compile.wants_compiled(1 << 30)
