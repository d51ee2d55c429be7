"""The native MXFP4 / block-FP8 kernels (quant/numerics/native/kernels.cpp) give the eager torch kernels' bits, on
the machine's own vector ISA and, in a subprocess, on AVX2 (ATEN_CPU_CAPABILITY=avx2), where the compiled torch
kernels (torch.compile) are checked too, from fresh inductor and kernel caches."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from quant.errors import QuantError
from quant.numerics import _native, fp8, mxfp4

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]  # compiles kernels: the slow tier


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """The library built into a cache of this module's own, so no other test's code path changes."""
    before = os.environ.get("QUANT_CACHE_DIR")
    os.environ["QUANT_CACHE_DIR"] = str(tmp_path_factory.mktemp("native-cache"))
    _native.library.cache_clear()
    try:
        if _native.build() is None or _native.library() is None:
            pytest.skip("no AVX2/AVX-512 capability or no C++ compiler: native kernels do not apply")
        yield _native.library()
    finally:
        os.environ["QUANT_CACHE_DIR"] = before or ""
        _native.library.cache_clear()


def all_finite_bf16() -> torch.Tensor:
    """Every finite bf16 value (both zeros included), 65,280 of them, in a seeded order."""
    v = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    v = v[torch.isfinite(v)]
    return v[torch.randperm(v.numel(), generator=torch.Generator().manual_seed(0))]


def mxfp4_cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    gauss = torch.randn(512, 1024, generator=g) * torch.exp2(torch.randint(-40, 40, (512, 32, 1), generator=g)
                                                            .float()).repeat_interleave(32, 1).view(512, 1024)
    every = all_finite_bf16()[: 65280 // 32 * 32].view(-1, 256)
    # blocks that put elements on the E2M1 midpoints (ties) and one bf16 step either side, for every scale rule
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 7.5, 8.0])
    steps = torch.stack([mids, torch.nextafter(mids.bfloat16().float(), torch.tensor(0.0)),
                         mids.bfloat16().float() * (1 + 2**-7)]).view(-1)[:32]
    amaxes = torch.tensor([6.0, 7.0, 7.5, 7.96875, 4.0, 3.0])
    ties = torch.cat([torch.cat([steps[:31], a.view(1)]) * 2.0**k for a in amaxes for k in range(-130, 124, 3)])
    ties = ties * torch.where(torch.rand(ties.shape, generator=g) < 0.5, -1.0, 1.0)
    tiny = torch.randn(64, 256, generator=g) * 2.0**-125  # blocks with byte < 3: re-encoded by the reference
    zeros = torch.zeros(4, 256)
    zeros[1] = -0.0
    return [gauss.bfloat16(), every, ties.view(-1, 32).bfloat16(), tiny.bfloat16(), zeros.bfloat16()]


def fp8_cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(384, 640, generator=g) * torch.exp2(torch.randint(-60, 60, (3, 1, 5, 1), generator=g)
                                                           .float()).expand(3, 128, 5, 128).reshape(384, 640)
    every = all_finite_bf16()[: 65280 // 128 * 128].view(-1, 128)[:384].float()
    sub = torch.randn(256, 256, generator=g) * 2.0**-130  # fp32 subnormal inputs, floor scale
    edge = torch.randn(200, 300, generator=g)  # partial edge tiles
    cases = [wide, every.repeat(1, 2), sub, edge, torch.zeros(128, 128)]
    return [c.to(dt) for c in cases for dt in (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("mode", ["floor", "even", "rceil"])
def test_mxfp4_native_equals_eager(native, mode):
    for x in mxfp4_cases():
        got = mxfp4.quantize_mxfp4(x, mode, compiled=True)
        want = mxfp4.quantize_mxfp4(x, mode, compiled=False)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (mode, x.shape)


def test_mxfp4_native_flags_non_finite(native):
    x = torch.randn(64, 64).bfloat16()
    for bad in (math.inf, -math.inf, math.nan):
        x[3, 7] = bad
        with pytest.raises(QuantError, match=r"\b1 non-finite"):
            mxfp4.quantize_mxfp4(x, compiled=True)


def test_fp8_native_equals_eager(native):
    for x in fp8_cases():
        got = fp8.quantize_fp8_block(x, compiled=True)
        want = fp8.quantize_fp8_block(x, compiled=False)
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)), (x.dtype, x.shape)
        assert torch.equal(got[1], want[1]), (x.dtype, x.shape)
    x = torch.randn(256, 256).bfloat16()
    x[130, 3] = math.nan
    with pytest.raises(QuantError, match=r"\b1 non-finite"):
        fp8.quantize_fp8_block(x, compiled=True)


def test_native_splits_across_threads_like_one_call(native, monkeypatch):
    x = mxfp4_cases()[0]
    one = mxfp4.quantize_mxfp4(x, compiled=True)
    monkeypatch.setattr(_native, "_MIN_BLOCKS_PER_THREAD", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert all(torch.equal(a, b) for a, b in zip(one, mxfp4.quantize_mxfp4(x, compiled=True)))
    w = fp8_cases()[0]
    assert torch.equal(fp8.quantize_fp8_block(w, compiled=True)[1], fp8.quantize_fp8_block(w, compiled=False)[1])


AVX2_PROBE = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import test_native as t
from quant.numerics import _native, _compile, fp8, mxfp4
out = {"isa": torch.backends.cpu.get_cpu_capability(), "native": _native.build() is not None}
def same(a, b):
    return all(torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                           y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y) for x, y in zip(a, b))
out["native_mxfp4"] = all(same(mxfp4.quantize_mxfp4(x, m, compiled=True), mxfp4.quantize_mxfp4(x, m, compiled=False))
                          for x in t.mxfp4_cases() for m in ("floor", "even", "rceil"))
out["native_fp8"] = all(same(fp8.quantize_fp8_block(x, compiled=True), fp8.quantize_fp8_block(x, compiled=False))
                        for x in t.fp8_cases())
# the torch kernels compiled by inductor for this ISA (what runs where the native library is not built)
w = mxfp4._as_pair_words(torch.cat([c.view(-1) for c in t.mxfp4_cases()[:3]]))
ru = torch.tensor(0x600000, dtype=torch.int32)
byte, shift, _ = mxfp4.BF16_SCALES.eager(w, ru)
out["inductor_mxfp4"] = (same(mxfp4.BF16_SCALES(w, ru, compiled=True), mxfp4.BF16_SCALES.eager(w, ru))
                         and same([mxfp4.BF16_CODES(w, shift, compiled=True)], [mxfp4.BF16_CODES.eager(w, shift)]))
x = t.fp8_cases()[0]
tiles = x.view(-1, 128, x.shape[1] // 128, 128)
out["inductor_fp8"] = same(fp8.QUANTIZE_TILES(tiles, compiled=True), fp8.QUANTIZE_TILES.eager(tiles))
out["broken"] = _compile.Kernel.any_broken
print(json.dumps(out))
"""


@pytest.mark.xdist_group("compile")
def test_avx2_native_and_inductor_kernels_equal_eager(tmp_path):
    """On AVX2 code (the ISA of machines without AVX-512), from empty caches: inductor's code for one ISA must
    never be reused for another, whose results can differ."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "QUANT_CACHE_DIR": str(tmp_path / "quant"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", AVX2_PROBE, os.path.dirname(__file__)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    if out["isa"] != "AVX2":
        pytest.skip(f"this CPU cannot run AVX2 code (capability {out['isa']})")
    assert out == {"isa": "AVX2", "native": True, "native_mxfp4": True, "native_fp8": True,
                   "inductor_mxfp4": True, "inductor_fp8": True, "broken": False}
