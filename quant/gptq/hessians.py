"""Input Hessians H = sum x x^T of a decoder layer's weights, accumulated while calibration tokens run through it.

Plain `nn.Linear` weights: a forward pre-hook adds every input row. Fused expert parameters (transformers'
`*Experts` modules: `gate_up_proj` [E, 2I, H] = cat(gate, up) per expert, `down_proj` [E, H, I], forward(hidden,
top_k_index, top_k_weights)): the module's forward is wrapped, and for each expert only the tokens the router sent
to it are added (gate/up: the hidden states; down: the gated activation of those tokens, computed with the expert's
current weights by the module's own `_apply_gate`: act(gate) * up, or MiniMax-M3's clamped swiglu). Token counts
are kept per expert, so experts that saw too few tokens can be treated apart (`quant.gptq.run`).
"""

from __future__ import annotations

import torch

from quant.errors import QuantError
from quant.gptq.solve import one_cpu_thread


def supported(layer: torch.nn.Module, key: str) -> bool:
    """Whether H can be collected for weight `key` of `layer`: an nn.Linear weight or a fused expert parameter."""
    path, param = key.rsplit(".", 1) if "." in key else ("", key)
    module = dict(layer.named_modules()).get(path)
    if isinstance(module, torch.nn.Linear):
        return param == "weight"
    return module is not None and param in ("gate_up_proj", "down_proj") and hasattr(module, "gate_up_proj")


def _act_times_up(module):
    """act(gate) * up of a gate_up output (transformers' default `_apply_gate`, for *Experts modules without one)."""
    def gated(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return module.act_fn(gate) * up
    return gated


class HessianCollector:
    """Accumulates H for the weights `keys` of `layer` (parameter names relative to the layer; fused expert
    parameters restricted to `experts` when given: an iterable of expert indices, or {key: iterable} per
    parameter) until `close()`.

    `hooks` (default): from the layer's own forwards, as they run. Without hooks the inputs are fed by hand,
    `feed_linear` / `feed_experts` with what an `InputRecorder` kept (a rank that owns these weights, fed by the
    ranks that ran the batches: `quant.gptq.ranks`); either way the same additions in the same order."""

    def __init__(self, layer: torch.nn.Module, keys: set[str], experts=None, hooks: bool = True):
        self.hessians: dict[str, torch.Tensor] = {}  # key -> [E or 1, K, K] fp32
        self.tokens: dict[str, torch.Tensor] = {}  # key -> [E or 1] int64
        self.handles, self.restore = [], []
        self.experts_state: dict[str, dict] = {}  # experts module path -> what feed_experts needs
        modules = dict(layer.named_modules())
        for key in sorted(keys):
            path, param = key.rsplit(".", 1) if "." in key else ("", key)
            module = modules.get(path)
            if isinstance(module, torch.nn.Linear) and param == "weight":
                self._hook_linear(key, module, hooks)
            elif module is not None and param in ("gate_up_proj", "down_proj") and hasattr(module, "gate_up_proj"):
                if path not in self.experts_state:
                    self._wrap_experts(path, module, keys, experts, hooks)
            else:
                raise QuantError(f"GPTQ: weight {key} is neither an nn.Linear weight nor a fused expert parameter "
                                 f"of a transformers *Experts module ({type(module).__name__})")

    def _add(self, key: str, slot: int, x: torch.Tensor, count: int) -> None:
        h = self.hessians[key]
        # One thread on CPU: MKL splits a tall X^T X over the tokens when it has several, so H's rounding followed
        # the thread count, and a run on ranks (each with its share of the cores) gave other codes than one process
        # (issue #48: 2,155 of 835,584 on an AVX-512 Xeon; 59,696 of 65,536 entries of a 4096-token X^T X differ
        # between 1 and 2 threads there).
        with one_cpu_thread(h.device):
            h[slot].addmm_(x.t(), x)
        self.tokens[key][slot] += count

    def _hook_linear(self, key: str, module: torch.nn.Linear, hooks: bool) -> None:
        k = module.in_features
        dev = module.weight.device
        self.hessians[key] = torch.zeros(1, k, k, dtype=torch.float32, device=dev)
        self.tokens[key] = torch.zeros(1, dtype=torch.int64)
        if hooks:
            self.handles.append(module.register_forward_pre_hook(lambda _module, args: self.feed_linear(key, args[0])))

    def feed_linear(self, key: str, x: torch.Tensor) -> None:
        """One call's input of linear `key` (any leading shape)."""
        k = self.hessians[key].shape[-1]
        x = x.reshape(-1, k).to(device=self.hessians[key].device, dtype=torch.float32)
        self._add(key, 0, x, x.shape[0])

    def _wrap_experts(self, path: str, module, keys: set[str], experts, hooks: bool) -> None:
        gate_up, down = module.gate_up_proj, module.down_proj
        e_count, two_i, hidden = gate_up.shape
        if down.shape != (e_count, hidden, two_i // 2):
            raise QuantError(f"GPTQ: {path} has gate_up_proj {list(gate_up.shape)} and down_proj "
                             f"{list(down.shape)}; expected [E, 2I, H] and [E, H, I] (transformers' fused layout)")
        dev = gate_up.device
        slots: dict[str, dict[int, int]] = {}  # key -> expert -> its slot in the key's H
        for key, k in ((f"{path}.gate_up_proj", hidden), (f"{path}.down_proj", two_i // 2)):
            if key in keys:
                chosen = range(e_count) if experts is None else experts.get(key, ()) if isinstance(experts, dict) \
                    else experts
                slots[key] = {e: i for i, e in enumerate(sorted(set(chosen)))}
                self.hessians[key] = torch.zeros(len(slots[key]), k, k, dtype=torch.float32, device=dev)
                self.tokens[key] = torch.zeros(len(slots[key]), dtype=torch.int64)
        self.experts_state[path] = {
            "module": module, "active": sorted({e for s in slots.values() for e in s}), "slots": slots,
            "hidden": hidden, "gu": f"{path}.gate_up_proj", "down": f"{path}.down_proj",
            "gated": getattr(module, "_apply_gate", None) or _act_times_up(module)}
        if not hooks:
            return
        original = module.forward

        def forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            self.feed_experts(path, hidden_states, top_k_index)
            return original(hidden_states, top_k_index, top_k_weights, *args, **kwargs)

        module.forward = forward
        self.restore.append((path, module))

    def feed(self, batch: dict) -> None:
        """What an `InputRecorder` kept of one batch (or the share of it an owner is sent), call by call."""
        for key, inputs in batch["linear"].items():
            for x in inputs:
                self.feed_linear(key, x)
        for path, calls in batch["experts"].items():
            for hidden_states, top_k_index in calls:
                self.feed_experts(path, hidden_states, top_k_index)

    def feed_experts(self, path: str, hidden_states: torch.Tensor, top_k_index: torch.Tensor) -> None:
        """One call of experts module `path`: each collected expert's H gets the tokens routed to it (gate_up:
        the hidden states; down: the gated activation of those tokens, from the expert's current weights)."""
        state = self.experts_state[path]
        module, slots, hidden, gated = state["module"], state["slots"], state["hidden"], state["gated"]
        gu, down = slots.get(state["gu"], {}), slots.get(state["down"], {})
        gate_up = module.gate_up_proj
        with torch.no_grad():
            x_all = hidden_states.reshape(-1, hidden).to(gate_up.device)
            routed = top_k_index.reshape(x_all.shape[0], -1).to(gate_up.device)
            for e in state["active"]:
                tokens = (routed == e).any(dim=-1).nonzero().view(-1)
                if tokens.numel() == 0:
                    continue
                x = x_all.index_select(0, tokens).to(torch.float32)
                if e in gu:
                    self._add(state["gu"], gu[e], x, tokens.numel())
                if e in down:
                    a = gated(torch.nn.functional.linear(x.to(gate_up.dtype), gate_up[e])).to(torch.float32)
                    self._add(state["down"], down[e], a, tokens.numel())

    def expert_slots(self, key: str) -> dict[int, int]:
        """{expert: its slot in hessians[key]} of a fused expert parameter `key`."""
        path = key.rsplit(".", 1)[0]
        return self.experts_state[path]["slots"][key]

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        for _, module in self.restore:
            del module.forward  # the instance attribute goes; the class's forward is back
        self.handles, self.restore = [], []


def _own(x: torch.Tensor) -> torch.Tensor:
    """`x` on the CPU in a storage of its own size: a view of a larger tensor is copied, since pickling it (to send it
    to another rank) would carry all of that tensor."""
    x = x.detach().cpu()
    return x if x.untyped_storage().nbytes() == x.nbytes and x.is_contiguous() else x.clone(
        memory_format=torch.contiguous_format)


class InputRecorder:
    """Keeps, batch by batch, what a `HessianCollector` is fed for the weights `keys` of `layer`: each call's input
    of a plain linear, and each call's hidden states and top-k indices of a fused experts module (on the CPU, in
    the layer's dtype), while the layer runs a rank's calibration batches. `batches[i]` is the i-th batch run:
    {"linear": {key: [inputs]}, "experts": {path: [(hidden_states, top_k_index)]}}; `next_batch()` starts one."""

    def __init__(self, layer: torch.nn.Module, keys: set[str]):
        self.batches: list[dict] = []
        self.handles, self.restore = [], []
        modules = dict(layer.named_modules())
        wrapped = set()
        for key in sorted(keys):
            path, param = key.rsplit(".", 1) if "." in key else ("", key)
            module = modules.get(path)
            if isinstance(module, torch.nn.Linear) and param == "weight":
                self.handles.append(module.register_forward_pre_hook(
                    lambda _m, args, key=key: self._keep("linear", key, _own(args[0]))))
            elif module is not None and hasattr(module, "gate_up_proj") and path not in wrapped:
                wrapped.add(path)
                self._wrap(path, module)

    def next_batch(self) -> None:
        self.batches.append({"linear": {}, "experts": {}})

    def _keep(self, kind: str, key: str, value) -> None:
        self.batches[-1][kind].setdefault(key, []).append(value)

    def _wrap(self, path: str, module) -> None:
        original = module.forward

        def forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            self._keep("experts", path, (_own(hidden_states), _own(top_k_index)))
            return original(hidden_states, top_k_index, top_k_weights, *args, **kwargs)

        module.forward = forward
        self.restore.append(module)

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        for module in self.restore:
            del module.forward
        self.handles, self.restore = [], []
