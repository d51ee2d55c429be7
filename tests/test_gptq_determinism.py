"""A GPTQ solve on CPU gives the same bytes whatever the intra-op thread count it runs with, so one worker (the
calling thread, torch's default thread count) and several (`Workers`: `process.cpu_threads(n)` threads each)
export the same bytes.

MKL's float64 Cholesky / inverse (LAPACK potrf, potri) round differently with different thread counts: at hidden
6144 with 4096 calibration tokens 98 of the fp32 factor's 37.7M entries differed between 1 and 2 threads, and a
[2048, 6144] weight solved with the two factors differed in 10 code bytes (the GLM-5-shaped benchmark of issue #24:
214 bytes of the shared expert's gate_proj between `--devices cpu` and `cpu,cpu`). `tests/test_gptq_parallel.py`
runs its toys under one thread everywhere, where this cannot show; here the single worker runs with 2 threads and
each of two workers with 1, as on a 2-core machine, at the smallest shape whose factor differed (K 2048, 1024
tokens: 6 to 9 entries per seed)."""

from __future__ import annotations

import functools

import pytest
import torch

from quant.gptq.schedule import Workers
from quant.gptq.solve import damped_inverse_factor, gptq_mxfp4

K, TOKENS = 2048, 1024


def _hessian(seed: int, k: int = K, tokens: int = TOKENS) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g) * (torch.rand(k, generator=g) * 3)  # rank-deficient, uneven columns
    return (x.t() @ x)[None]


def _factor(h, device):
    return damped_inverse_factor(h.to(device), torch.tensor([0.01 * K / TOKENS]))[0]


def _solve(w, h, device):
    solved = gptq_mxfp4(w.to(device), h.to(device), "even", 0.02)
    return solved.packed, solved.scales


@pytest.fixture
def two_threads_here_one_per_worker(monkeypatch):
    """The calling thread (one worker) with 2 intra-op threads, each of two workers with 1."""
    monkeypatch.setattr("quant.process.cpu_threads", lambda workers: 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_the_cholesky_factor_does_not_depend_on_the_thread_count(two_threads_here_one_per_worker):
    hessians = [_hessian(0), _hessian(1)]
    tasks = [functools.partial(_factor, h) for h in hessians]
    with Workers(["cpu"]) as one:
        alone = [r for _, r in one.run(tasks, [1.0, 1.0])]
    with Workers(["cpu", "cpu"]) as two:
        shared = two.run(tasks, [1.0, 1.0])
    assert sorted(w for w, _ in shared) == [0, 1]  # each factor computed in a worker thread of its own
    for i, (a, (_, b)) in enumerate(zip(alone, shared)):
        assert torch.equal(a, b), f"Hessian {i}: {int((a != b).sum())} of {a.numel()} factor entries differ"
    assert torch.get_num_threads() == 2  # the caller's thread count is back


def test_a_solve_gives_the_same_bytes_in_the_caller_and_in_a_worker(two_threads_here_one_per_worker):
    """The whole solve (factor, column loop, lazy updates) at half the width: the same codes and scales."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(2, 64, K // 2, generator=g) * 0.02
    tasks = [functools.partial(_solve, w, torch.cat([_hessian(s, K // 2, TOKENS // 2) for s in (0, 1)])),
             functools.partial(_solve, w[:1], _hessian(3, K // 2, TOKENS // 2))]
    with Workers(["cpu"]) as one:
        alone = [r for _, r in one.run(tasks, [1.0, 1.0])]
    with Workers(["cpu", "cpu"]) as two:
        shared = [r for _, r in two.run(tasks, [1.0, 1.0])]
    for (packed_a, scales_a), (packed_b, scales_b) in zip(alone, shared):
        assert torch.equal(packed_a, packed_b) and torch.equal(scales_a, scales_b)
