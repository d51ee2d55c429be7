"""The estimate that scales: each choice's damage from one streamed forward and one streamed backward pass, with
one decoder layer in memory at a time (the layer reader of GPTQ's calibration, quant.model_exec.DecoderStack).

The second-order estimate of the calibration NLL's rise when a layer's output moves by dY, with the empirical
Fisher (one outer product g g^T per calibration window) for its curvature, taken at a decoder layer's output
(the residual stream) so that fused experts and fused projections need no hooks:

    loss(unit, format) = 1/2 * sum over windows w of <g_w, dY_w>^2 / predicted tokens

where g_w is the gradient of window w's summed NLL with respect to the layer's output and dY_w the change of that
output, over all of the window's positions and channels, when only this unit's weights are quantized and
dequantized (the layer's input being the BF16 model's). In nats per predicted token, as the exact measure
(sensitivity.py); never negative. ModelOpt AutoQuantize's gradient score is the diagonal of the same form, per
linear; on tests/data/gptq_toy the diagonal ranks the choices as the exact KL does (Spearman 0.96) but totals a
third of it, the windows' outer products rank them at 0.996 and total 0.99 of it (BENCHMARKS.md).

Resumable: given a state directory, each finished layer's losses and the gradient at the boundary below it are
kept there (`EstimateState`), keyed by the bytes every layer was read from, the calibration tokens and the menus; a
rerun after an interruption redoes the forward pass and resumes the backward pass below the last finished layer.

Cost: the forward pass keeps each layer's input (windows x tokens x hidden floats a layer); the backward pass
runs each layer once with autograd and once per (unit, format) of the layer without it. Memory: one layer's
weights and activations beside those inputs. Nothing here needs the model whole, so it runs wherever GPTQ runs.
"""

from __future__ import annotations

import hashlib
import io
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch  # the search's modules are imported when a search runs, never at the command line's start

from quant.errors import QuantError
from quant.files import write_atomic
from quant.model_exec.layers import DecoderStack
from quant.planning.schemes import Scheme
from quant.planning.treatment import layer_of
from quant.search.units import Linear, Unit

SchemeOf = Callable[[str, str], "Scheme | None"]


def fisher_losses(src: Path, ckpt, layer_returns: list[str], units: list[Unit], menus: dict[str, list[str]],
                  linears: dict[str, Linear], scheme_of: SchemeOf, tokens: torch.Tensor, scale_mode: str,
                  batch: int = 8, log: Callable[[str], None] = print,
                  state_dir: Path | None = None) -> dict[str, dict[str, float]]:
    """unit name -> treatment -> estimated loss (nats per predicted token), for every unit of the main layers;
    with `state_dir`, resumable (EstimateState)."""
    stack = DecoderStack(src, ckpt, layer_returns, "cpu", torch.float32)
    by_layer: dict[int, list[Unit]] = {}
    for unit in units:
        at = layer_of(unit.modules[0])
        if not unit.mtp and at is not None:  # a unit is one layer's (units.search_units)
            by_layer.setdefault(at, []).append(unit)
    hidden = stack.capture(tokens, batch)
    carry: list[dict] = [{} for _ in hidden]
    inputs: list[tuple[list, list[dict]] | None] = []
    with torch.no_grad():
        for index in range(len(stack)):
            layer = stack.load_layer(index)
            inputs.append((hidden, carry))
            hidden, carry = stack.forward(index, layer, hidden, carry)
            _unload(stack, index)
    state = EstimateState(state_dir, _state_key(stack, tokens, by_layer, menus, scale_mode)) if state_dir else None
    resumed = state.load() if state else None
    if resumed is not None:
        start, losses, grads = resumed
        log(f"  resuming the estimate below layer {start + 1} ({state_dir})")
    else:
        start, losses = len(stack) - 1, {}
        grads = _head_gradients(stack, ckpt, hidden, carry, tokens, batch)
    count = tokens.shape[0] * (tokens.shape[1] - 1)
    for index in reversed(range(start + 1)):
        layer = stack.load_layer(index)
        layer.requires_grad_(False)
        xs, carries = inputs[index] or ([], [])
        outputs, below = [], []
        for b, x in enumerate(xs):
            x = x.detach().requires_grad_(True)
            with torch.enable_grad():
                y = _hidden_of(layer(x, **stack.layer_kwargs(index, x.shape[0]), **carries[b]))
                y.backward(grads[b])
            outputs.append(y.detach())
            below.append(x.grad)
        for unit in by_layer.get(index, []):
            for treatment in menus[unit.name]:
                chosen = [(linears[m], s) for m in unit.modules if (s := scheme_of(m, treatment)) is not None]
                score = 0.0
                if chosen:
                    with torch.no_grad(), _quantized(stack, layer, index, chosen, scale_mode):
                        for b, x in enumerate(xs):
                            y = _hidden_of(layer(x, **stack.layer_kwargs(index, x.shape[0]), **carries[b]))
                            score += float(((y - outputs[b]) * grads[b]).sum(dim=(1, 2)).pow(2).sum())  # per window
                losses.setdefault(unit.name, {})[treatment] = 0.5 * score / count
                log(f"  {unit.name}: {treatment} estimated {losses[unit.name][treatment]:.6f}")
        grads, inputs[index] = below, None
        _unload(stack, index)
        if state is not None:
            state.save(index - 1, losses, grads)
    return losses


class EstimateState:
    """The streamed estimate's progress in a directory: the losses of every finished layer and the gradient at
    the boundary below the last of them, valid only for the `key` they were computed under. Written gradients
    first, then the record naming them (each atomically): an interruption at any point leaves a consistent pair."""

    RECORD, GRADIENTS = "estimate.json", "estimate-gradients.pt"

    def __init__(self, root: Path, key: str):
        self.root, self.key = Path(root), key

    def load(self) -> tuple[int, dict[str, dict[str, float]], list[torch.Tensor]] | None:
        """(the next layer to compute, the losses so far, the gradients at its output), or None to start over."""
        try:
            record = json.loads((self.root / self.RECORD).read_text())
            saved = torch.load(self.root / self.GRADIENTS, weights_only=True)
        except (OSError, ValueError, RuntimeError):
            return None
        if record.get("key") != self.key or saved.get("next") != record.get("next"):
            return None
        return int(record["next"]), record["losses"], list(saved["gradients"])

    def save(self, next_index: int, losses: dict[str, dict[str, float]], gradients: list[torch.Tensor]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        torch.save({"next": next_index, "gradients": gradients}, buffer)
        write_atomic(self.root / self.GRADIENTS, buffer.getvalue())
        write_atomic(self.root / self.RECORD, json.dumps({"key": self.key, "next": next_index, "losses": losses}))


def _state_key(stack: DecoderStack, tokens: torch.Tensor, by_layer: dict[int, list[Unit]],
               menus: dict[str, list[str]], scale_mode: str) -> str:
    """What the losses depend on: the bytes every layer was read from (the stack's sha256 of each load), the
    calibration tokens, each layer's units and menus, the scale rule."""
    payload = {"layers": {str(k): v for k, v in stack.identity.items()},
               "tokens": hashlib.sha256(tokens.numpy().tobytes()).hexdigest(),
               "units": {str(i): [[u.name, list(u.modules), menus[u.name]] for u in us] for i, us in by_layer.items()},
               "scale_mode": scale_mode, "estimate": 1}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _hidden_of(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _unload(stack: DecoderStack, index: int) -> None:
    """Free the layer's weights but keep its structure: the backward pass loads it again."""
    stack.layers[index] = stack.layers[index].to("meta")


def _head_gradients(stack: DecoderStack, ckpt, hidden: list, carry: list[dict], tokens: torch.Tensor,
                    batch: int) -> list[torch.Tensor]:
    """d(summed NLL of each window)/d(last decoder layer's output), per batch. The text model's own code after
    its layers (a final norm; GLM-5.3-Flash's and Qwen4-Exp's hyper-connection heads) runs on that output: the
    last layer is stood in for by one that returns it, the others pass their input through (the stack's
    recorders), then the LM head (or the tied embedding)."""
    heads = [n for n in ckpt.tensors
             if n == "lm_head.weight" or (n.endswith(".lm_head.weight") and ".layers." not in n)]
    weight = stack.read(heads[0]) if heads else stack.text.get_input_embeddings().weight.detach()  # tied
    last = len(stack.text.layers) - 1
    recorder = stack.text.layers[last]
    grads = []
    try:
        for b, h in enumerate(hidden):
            h = h.detach().requires_grad_(True)
            stack.text.layers[last] = _Returns(h, [carry[b].get(name) for name in stack.returns[1:]])
            ids = tokens[b * batch:(b + 1) * batch]
            with torch.enable_grad():
                out = stack.text(input_ids=ids, use_cache=False).last_hidden_state
                logits = (out @ weight.T.to(out.dtype)).float()
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                         ids[:, 1:].reshape(-1), reduction="sum")
                loss.backward()
            stack.first_inputs = []  # what the pass-through recorders kept: not wanted
            if h.grad is None:
                raise QuantError(f"{ckpt.root}: the text model's output does not depend on its last decoder layer's "
                                 "output as the streamed estimate expects (use --sensitivity kl)")
            grads.append(h.grad)
    finally:
        stack.text.layers[last] = recorder
    return grads


class _Returns(torch.nn.Module):
    """Stands in for the last decoder layer: returns the given output whatever it is passed."""

    def __init__(self, hidden: torch.Tensor, carried: list):
        super().__init__()
        self.hidden, self.carried = hidden, carried

    def forward(self, *args, **kwargs):
        return self.hidden if not self.carried else (self.hidden, *self.carried)


@contextmanager
def _quantized(stack: DecoderStack, layer: torch.nn.Module, index: int, linears: list[tuple[Linear, Scheme]],
               scale_mode: str) -> Iterator[None]:
    """The loaded layer with these linears' weights quantized and dequantized, restored after."""
    saved = []
    try:
        for linear, scheme in linears:
            slot = stack.slot(index, linear.source.name, linear.source.expert, linear.source.rows)
            view = layer.get_parameter(slot.key).data
            if slot.expert is not None:
                view = view[slot.expert]
            if slot.rows is not None:
                view = view[slot.rows[0]:slot.rows[1]]
            saved.append((view, view.clone()))
            view.copy_(scheme.dequantize(scheme.quantize(view.clone().float(), scale_mode)).to(view.dtype))
        yield
    finally:
        for view, original in saved:
            view.copy_(original)
