"""Each choice's loss, measured: the mean KL divergence (nats per predicted token) of the model's next-token
distribution with only that unit's weights quantized and dequantized, from the BF16 model's own, on calibration
windows. The model is an in-memory copy of the BF16 checkpoint (transformers builds it from config.json, in fp32,
as the held-out NLL of the eval stage does).

Why KL and not the NLL's rise: where the BF16 model predicts the text well, the expected rise of NLL equals this
KL, but the measured rise carries the text's noise twice over and goes negative for small damage (a knapsack then
buys that noise: it picked an assignment 0.0003 nats worse on held-out text than the one it was measured to beat).
KL is never negative and compares the two models on the same positions, so small damages rank consistently.
Exact per unit; the solver then assumes the losses add up, which is what makes the search a knapsack.
"""

from __future__ import annotations

import re
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from quant.errors import QuantError
from quant.planning.schemes import Scheme
from quant.search.units import Linear

if TYPE_CHECKING:
    import torch


def load_model(src: Path) -> "torch.nn.Module":
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # an MTP layer's tensors are "unexpected" to transformers, as always
    try:
        return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    finally:
        hf_logging.set_verbosity(verbosity)


def reference_logprobs(model: "torch.nn.Module", windows: "torch.Tensor", batch: int = 16) -> list["torch.Tensor"]:
    """The model's next-token log-probabilities over `windows`, per batch (what `mean_kl` compares against)."""
    import torch

    with torch.no_grad():
        return [torch.log_softmax(model(input_ids=windows[s:s + batch], use_cache=False).logits.float()[:, :-1], -1)
                for s in range(0, windows.shape[0], batch)]


def mean_kl(model: "torch.nn.Module", windows: "torch.Tensor", reference: list["torch.Tensor"],
            batch: int = 16) -> float:
    """Mean KL(reference || model) per predicted token (nats) over the positions `reference` was taken at."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for ref, start in zip(reference, range(0, windows.shape[0], batch)):
            logits = model(input_ids=windows[start:start + batch], use_cache=False).logits.float()[:, :-1]
            logq = torch.log_softmax(logits, dim=-1)
            total += float((ref.exp() * (ref - logq)).sum())
            count += ref.shape[0] * ref.shape[1]
    return total / max(count, 1)


def mean_nll(windows: "torch.Tensor", reference: list["torch.Tensor"], batch: int = 16) -> float:
    """Mean NLL per predicted token (nats) of the model whose log-probabilities `reference` holds (no forward)."""
    total, count = 0.0, 0
    for ref, start in zip(reference, range(0, windows.shape[0], batch)):
        ids = windows[start:start + batch]
        total -= float(ref.gather(-1, ids[:, 1:].unsqueeze(-1)).sum())
        count += ref.shape[0] * ref.shape[1]
    return total / max(count, 1)


EXPERT = re.compile(r"^(?P<moe>.*\.experts)\.(?P<e>\d+)\.(?P<leaf>\w+)\.weight$")
# How transformers stores per-expert checkpoint weights once loaded (its MoE classes fuse them): gate and up
# stacked along the rows of gate_up_proj [experts, 2 * inter, hidden], down_proj [experts, hidden, inter].
FUSED_BY_TRANSFORMERS = {"gate_proj": ("gate_up_proj", 0, 2), "up_proj": ("gate_up_proj", 1, 2),
                         "down_proj": ("down_proj", 0, 1)}


def weight_view(model: "torch.nn.Module", linear: Linear) -> "torch.Tensor":
    """The model's parameter slice holding `linear`: its own parameter, or its rows of an expert tensor that the
    checkpoint (the plan's source: expert, rows) or transformers (FUSED_BY_TRANSFORMERS) fused. Checked against
    the checkpoint by `check_views` before anything is measured."""
    source = linear.source
    m = EXPERT.match(source.name)
    if source.expert is None and m and m.group("leaf") in FUSED_BY_TRANSFORMERS:
        fused, part, parts = FUSED_BY_TRANSFORMERS[m.group("leaf")]
        with suppress(AttributeError):
            stacked = model.get_parameter(f"{m.group('moe')}.{fused}").data[int(m.group("e"))]
            step = stacked.shape[0] // parts
            return stacked[part * step:(part + 1) * step]
    view = model.get_parameter(source.name).data
    if source.expert is not None:
        view = view[source.expert]
    if source.rows is not None:
        view = view[source.rows[0]:source.rows[1]]
    return view


def check_views(model: "torch.nn.Module", linears: list[Linear], read: Callable[[Linear], "torch.Tensor"]) -> None:
    """Every view holds its checkpoint weight exactly (a wrong mapping would measure another matrix)."""
    import torch

    for linear in linears:
        view = weight_view(model, linear)
        if view.shape != torch.Size(linear.shape) or not torch.equal(view, read(linear).to(view.dtype)):
            raise QuantError(f"{linear.module}: the model built by transformers does not hold this weight where "
                             "the search looks for it; quant search cannot measure this model")


@contextmanager
def quantized(model: "torch.nn.Module", linears: list[tuple[Linear, Scheme]], scale_mode: str) -> Iterator[None]:
    """The model with these linears' weights replaced by their quantized-dequantized values, restored after."""
    saved = []
    try:
        for linear, scheme in linears:
            view = weight_view(model, linear)
            saved.append((view, view.clone()))
            view.copy_(scheme.dequantize(scheme.quantize(view.clone(), scale_mode)).to(view.dtype))
        yield
    finally:
        for view, original in saved:
            view.copy_(original)
