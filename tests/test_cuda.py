"""On CUDA the numerics and the round-to-nearest export are the bytes the CPU gives, and the in-process eval runs a
model there (issue #44 item 1). Skipped where no CUDA device is visible; `scripts/device_check.sh` runs them on the
GPU box."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quant.numerics import SCALE_MODES, fp8, mxfp4, mxfp8

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")]


def _inputs(dtype: torch.dtype) -> torch.Tensor:
    """Values across the whole E8M0 range, zero blocks, exact E2M1 midpoints (ties) and subnormals."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 1024, generator=g) * torch.logspace(-30, 3, 1024)
    x[0, :64] = 0.0
    x[1, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)
    x[2, :32] = torch.finfo(torch.float32).tiny * torch.arange(32)
    return x.to(dtype)


def _same(a, b) -> bool:
    a, b = a.cpu(), b.cpu()
    if a.dtype.is_floating_point and a.element_size() == 1:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("compiled", [False, None])
@pytest.mark.parametrize("mode", SCALE_MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mxfp4_on_cuda_is_the_cpu_bytes(dtype, mode, compiled):
    x = _inputs(dtype)
    cpu = mxfp4.quantize_mxfp4(x, mode, compiled=False)
    gpu = mxfp4.quantize_mxfp4(x.cuda(), mode, compiled=compiled)
    assert all(t.device.type == "cuda" for t in gpu)
    assert _same(gpu[0], cpu[0]) and _same(gpu[1], cpu[1])
    back = mxfp4.dequantize_mxfp4(*gpu, torch.float32)
    assert _same(back, mxfp4.dequantize_mxfp4(*cpu, torch.float32))


@pytest.mark.parametrize("mode", ["even", "floor", "rceil"])
def test_mxfp8_on_cuda_is_the_cpu_bytes(mode):
    x = _inputs(torch.bfloat16)
    if mode not in getattr(mxfp8, "SCALE_MODES", SCALE_MODES):
        pytest.skip(f"MXFP8 has no scale mode {mode}")
    cpu, gpu = mxfp8.quantize_mxfp8(x, mode), mxfp8.quantize_mxfp8(x.cuda(), mode)
    assert _same(gpu[0], cpu[0]) and _same(gpu[1], cpu[1])


@pytest.mark.parametrize("compiled", [False, None])
def test_fp8_block_and_per_channel_on_cuda_are_the_cpu_bytes(compiled):
    x = _inputs(torch.bfloat16)[:, :1000]  # partial 128x128 tiles
    for quantize in (fp8.quantize_fp8_block, fp8.quantize_fp8_per_channel):
        cpu, gpu = quantize(x, compiled=False), quantize(x.cuda(), compiled=compiled)
        assert _same(gpu[0], cpu[0]) and _same(gpu[1], cpu[1]), quantize.__name__


def test_a_round_to_nearest_export_on_cuda_is_the_cpu_export(toy_factory, tmp_path):
    from quant.pipeline import quantize_checkpoint

    src = toy_factory("glm5")
    cpu = quantize_checkpoint(src, tmp_path / "cpu", devices="cpu", check_engines=None, log=lambda m: None)
    gpu = quantize_checkpoint(src, tmp_path / "gpu", devices="cuda:0", check_engines=None, log=lambda m: None)
    assert gpu["run"]["devices"] == ["cuda:0"]
    assert gpu["output"]["shards"] == cpu["output"]["shards"]


def test_the_in_process_eval_runs_on_cuda():
    """The trained demo toy scores on CUDA what it scores on CPU (greedy, float32)."""
    from evals.arms.nll import mean_nll

    texts = ["12 + 30 = 42", "7 + 8 = 15"]
    root = Path(__file__).resolve().parent.parent / "evals" / "data" / "toy_arith" / "model"
    cpu = mean_nll(root, texts, device="cpu")
    gpu = mean_nll(root, texts, device="cuda:0")
    assert abs(cpu - gpu) < 1e-3, (cpu, gpu)
