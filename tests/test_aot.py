"""Ahead-of-time compiled kernels: packages built per machine load without dynamo and give the eager bits; a
missing or damaged package falls back, and a changed kernel source never picks up a stale package."""

import json
import logging
import subprocess
import sys

import pytest
import torch

from quant.numerics import _aot, mxfp4

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("compile")]  # compiles packages: the slow tier

PROBE = """
import json, sys, torch
import quant
from quant.numerics import mxfp4
x = (torch.randn(2048, 1024, generator=torch.Generator().manual_seed(3)) * 0.02).bfloat16()
x[0, :32] = 0
packed, scales = mxfp4.quantize_mxfp4(x, compiled=True)
eager = mxfp4.quantize_mxfp4(x, compiled=False)
print(json.dumps({"dynamo": "torch._dynamo" in sys.modules, "equal": torch.equal(packed, eager[0])
                  and torch.equal(scales, eager[1])}))
"""


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory):
    """A cache holding packages of the two bf16 MXFP4 kernels, built in a subprocess (about 20 s)."""
    cache = tmp_path_factory.mktemp("kernels")
    build = ("import quant\nfrom quant.numerics import mxfp4\n"
             "for k in (mxfp4.BF16_SCALES, mxfp4.BF16_CODES):\n    print(list(k.build_aot()))")
    env = {**_env(), "QUANT_CACHE_DIR": str(cache)}
    subprocess.run([sys.executable, "-c", build], check=True, env=env, capture_output=True, text=True)
    return cache


def _env():
    import os

    return dict(os.environ)


def test_package_gives_eager_bits_without_loading_dynamo(built_cache):
    env = {**_env(), "QUANT_CACHE_DIR": str(built_cache)}
    out = subprocess.run([sys.executable, "-c", PROBE], check=True, env=env, capture_output=True, text=True)
    assert json.loads(out.stdout.splitlines()[-1]) == {"dynamo": False, "equal": True}
    # Each package records the vector width kept (on AVX-512 machines the faster of 512 and 256 bits); the probe
    # above checked that whichever was kept gives the eager bits.
    packages = list(built_cache.rglob("*.pt2"))
    assert len(packages) == 2
    assert {_aot.package_simdlen(p) for p in packages} <= {"native", "256"}


def test_kernels_status_reports_built_and_missing(built_cache):
    env = {**_env(), "QUANT_CACHE_DIR": str(built_cache)}
    out = subprocess.run([sys.executable, "-m", "quant.cli", "kernels", "status"], check=True, env=env,
                         capture_output=True, text=True).stdout
    assert "built    bf16_codes(int32_2d-int32_2d)" in out
    assert "missing  codes(int64_2d-uint8_2d)" in out and "run `quant kernels build`" in out


def test_package_key_follows_kernel_source_torch_and_signature(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANT_CACHE_DIR", str(tmp_path))
    args = (torch.zeros(8, 16, dtype=torch.int32), torch.tensor(0, dtype=torch.int32))
    path = _aot.package_path(mxfp4._bf16_scales, "bf16_scales", _aot.signature(args))
    assert path.is_relative_to(tmp_path) and torch.__version__ in str(path)
    assert _aot.signature(args) == "int32_2d-int32_0d"
    _aot._source_digest.cache_clear()
    edited = tmp_path / "mxfp4_edited.py"
    edited.write_text(open(mxfp4.__file__).read() + "\n# edited\n")
    assert _aot._source_digest(str(edited)) != _aot._source_digest(mxfp4.__file__)


def test_damaged_package_falls_back_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("QUANT_CACHE_DIR", str(tmp_path))
    x = (torch.randn(64, 256) * 0.02).bfloat16()
    w = x.view(torch.int32).view(-1, 16)
    rounding = torch.tensor(0x600000, dtype=torch.int32)
    path = _aot.package_path(mxfp4._bf16_scales, "bf16_scales", _aot.signature((w, rounding)))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a package")
    cache = _aot.AotCache(mxfp4._bf16_scales, "bf16_scales")
    with caplog.at_level(logging.WARNING):
        assert cache.runner((w, rounding)) is None
    assert "cannot load the compiled kernel" in caplog.text
    # None = a package if there is one, else eager: the damaged package costs nothing but the warning
    assert torch.equal(mxfp4.quantize_mxfp4(x, compiled=None)[0], mxfp4.quantize_mxfp4(x, compiled=False)[0])


def test_error_sums_equal_dequantize_then_compare():
    x = torch.randn(300, 512, generator=torch.Generator().manual_seed(5)).bfloat16()
    packed, scales = mxfp4.quantize_mxfp4(x)
    noise, signal = mxfp4.quantization_error(x, packed, scales, compiled=False)
    d = x.double() - mxfp4.dequantize_mxfp4(packed, scales, torch.float32).double()
    assert noise == pytest.approx(float((d * d).sum()), rel=1e-6)  # fp32 sums per row
    assert signal == pytest.approx(float(x.double().square().sum()), rel=1e-6)
