"""GPTQ for MXFP4: round a weight's columns in order, each column's rounding error pushed onto the columns not yet
rounded through the inverse input Hessian (Frantar et al. 2022, "GPTQ", Algorithm 1 with lazy batch updates).

MXFP4 specifics: the 32 columns of a block share one E8M0 scale. When the solver reaches a block's first column,
that block's scale is chosen by the checkpoint's scale rule (`--scale-mode`, `mxfp4.quantize_mxfp4`) from the
block's weights as they stand then (already corrected by the errors of every earlier column), and is fixed before
any of its columns is rounded; each column is then rounded on that scale's grid by `quantize_mxfp4`'s own rule.
The result is therefore an ordinary MXFP4 tensor: packed codes and scale bytes.

Every function works on a stack of E matrices at once (W [E, R, K], H [E, K, K]): the experts of a MoE layer are
solved together, one column loop for all of them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from quant.numerics import mxfp4

BLOCK = mxfp4.BLOCK
LAZY_COLUMNS = 128  # columns per lazy batch update; a multiple of BLOCK, so no scale block straddles two batches


@dataclass
class Solved:
    packed: torch.Tensor  # uint8 [E, R, K/2]
    scales: torch.Tensor  # uint8 [E, R, K/32]
    values: torch.Tensor  # fp32 [E, R, K]: the dequantized weight (what the engines compute with)
    damping: torch.Tensor  # fp32 [E]: the relative damping each matrix was solved with


def damped_inverse_factor(h: torch.Tensor, damp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Upper Cholesky factor of H^-1 for each H [E, K, K] (fp32), after adding damp[e] * mean(diag H[e]) to the
    diagonal. Columns no calibration token reached (zero diagonal) get 1, so they are rounded to nearest and
    spread no error. A matrix that is still not positive definite gets ten times the damping, up to three times.
    Computed on one intra-op thread on CPU (`one_cpu_thread`): the same bytes in any worker.
    Returns (factor [E, K, K], the damping used [E])."""
    with one_cpu_thread(h.device):
        h = h.to(torch.float64).clone()
        k = h.shape[-1]
        diag = h.diagonal(dim1=-2, dim2=-1)
        dead = diag == 0
        diag[dead] = 1.0
        mean = diag.mean(dim=-1)
        damp = damp.to(torch.float64).clone()
        eye = torch.eye(k, dtype=torch.float64, device=h.device)
        for _ in range(4):
            chol, info = torch.linalg.cholesky_ex(h + (damp * mean)[:, None, None] * eye)
            bad = info != 0
            if not bool(bad.any()):
                break
            damp = torch.where(bad, damp * 10, damp)
        else:
            raise ValueError("the Hessian is not positive definite even with 1000x damping")
        inverse = torch.cholesky_inverse(chol)
        factor = torch.linalg.cholesky(inverse, upper=True)
        return factor.to(torch.float32), damp.to(torch.float32)


@contextlib.contextmanager
def one_cpu_thread(device: torch.device):
    """One intra-op thread for the calling thread (CPU tensors), its own count back after.

    Why: MKL's LAPACK (potrf, potri) rounds differently with different thread counts, and the solver's fp32 factor
    then differs in a few entries (98 of 37.7M at K 6144 between 1 and 2 threads), enough to flip codes: one
    worker solves in the calling thread (torch's default, every core), each of several CPU workers with
    `process.cpu_threads(n)`, and their exports differed (issue #24: 214 bytes of a [2048, 6144] weight). A fixed
    count makes the factor a function of the Hessian alone. The column loop (elementwise ops, and fp32 matmuls
    whose inner dimension is one 128-column batch) gave the same bytes at 1 and 2 threads, and keeps its threads.
    One thread costs little: the factorisation was 14 s at K 6144 on one core of the 2-core VM, 66 s on two
    beside a loaded neighbour; on a many-core machine several CPU workers keep the cores busy."""
    if device.type != "cpu" or torch.get_num_threads() == 1:
        yield
        return
    before = torch.get_num_threads()  # per thread: OpenMP and MKL (mkl_set_num_threads_local) keep their own
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def gptq_mxfp4(weight: torch.Tensor, hessian: torch.Tensor, scale_mode: str = "even",
               damp: float | torch.Tensor = 0.01) -> Solved:
    """Quantize W [E, R, K] (any float dtype; K % 32 == 0) to MXFP4 with GPTQ, given the input Hessians
    H [E, K, K] = sum over calibration tokens of x x^T (any positive scale; only its shape matters).

    With a diagonal H nothing is propagated and the result equals round-to-nearest (`quantize_mxfp4`) exactly."""
    e, rows, k = weight.shape
    damp_t = torch.as_tensor(damp, dtype=torch.float32, device=weight.device).expand(e)
    factor, used = damped_inverse_factor(hessian, damp_t)
    w = weight.to(torch.float32).clone()
    values = torch.empty_like(w)
    scales = torch.empty(e, rows, k // BLOCK, dtype=torch.uint8, device=w.device)
    for c0 in range(0, k, LAZY_COLUMNS):
        c1 = min(c0 + LAZY_COLUMNS, k)
        w1, f1 = w[:, :, c0:c1].clone(), factor[:, c0:c1, c0:c1]
        err1 = torch.empty_like(w1)
        for i in range(c1 - c0):
            if i % BLOCK == 0:  # a new scale block: its scale from its current (corrected) weights
                # eager: one call per block and shape; torch.compile would specialise on each
                _, block_scale = mxfp4.quantize_mxfp4(w1[:, :, i:i + BLOCK].contiguous(), scale_mode, compiled=False)
                scales[:, :, (c0 + i) // BLOCK] = block_scale[..., 0]
            q = mxfp4.round_with_scales(w1[:, :, i], block_scale[..., 0])
            values[:, :, c0 + i] = q
            err = (w1[:, :, i] - q) / f1[:, i, i].unsqueeze(-1)
            w1[:, :, i:] -= err.unsqueeze(-1) * f1[:, i, i:].unsqueeze(1)
            err1[:, :, i] = err
        w[:, :, c1:] -= err1 @ factor[:, c0:c1, c1:]
    packed = mxfp4.encode_with_scales(values, scales)
    return Solved(packed=packed, scales=scales, values=values, damping=used)


def output_error(weight: torch.Tensor, values: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """Relative output error on the calibration inputs, per matrix: tr(D H D^T) / tr(W H W^T) with D = W - Q, i.e.
    ||X (W - Q)^T||^2 / ||X W^T||^2 over the tokens that built H. [E] fp32 (0 where the output is zero).

    The traces are summed in float64: an fp32 reduction over R x K rounds by the thread count, and the manifest of a
    run on ranks (each on its share of the cores) recorded other errors than one process's."""
    w = weight.to(torch.float32)
    d = w - values
    h = hessian.to(torch.float32)
    num = ((d @ h).double() * d.double()).sum(dim=(-2, -1))
    den = ((w @ h).double() * w.double()).sum(dim=(-2, -1))
    return torch.where(den > 0, num / den.clamp_min(1e-30), torch.zeros_like(den)).to(torch.float32)
