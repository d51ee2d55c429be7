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
    parameters restricted to `experts`, an iterable of expert indices, when given) until `close()`."""

    def __init__(self, layer: torch.nn.Module, keys: set[str], experts=None):
        self.hessians: dict[str, torch.Tensor] = {}  # key -> [E or 1, K, K] fp32
        self.tokens: dict[str, torch.Tensor] = {}  # key -> [E or 1] int64
        self.handles, self.restore = [], []
        modules = dict(layer.named_modules())
        for key in sorted(keys):
            path, param = key.rsplit(".", 1) if "." in key else ("", key)
            module = modules.get(path)
            if isinstance(module, torch.nn.Linear) and param == "weight":
                self._hook_linear(key, module)
            elif module is not None and param in ("gate_up_proj", "down_proj") and hasattr(module, "gate_up_proj"):
                if path not in [p for p, _ in self.restore]:
                    self._wrap_experts(path, module, keys, experts)
            else:
                raise QuantError(f"GPTQ: weight {key} is neither an nn.Linear weight nor a fused expert parameter "
                                 f"of a transformers *Experts module ({type(module).__name__})")

    def _add(self, key: str, slot: int, x: torch.Tensor, count: int) -> None:
        h = self.hessians[key]
        h[slot].addmm_(x.t(), x)
        self.tokens[key][slot] += count

    def _hook_linear(self, key: str, module: torch.nn.Linear) -> None:
        k = module.in_features
        dev = module.weight.device
        self.hessians[key] = torch.zeros(1, k, k, dtype=torch.float32, device=dev)
        self.tokens[key] = torch.zeros(1, dtype=torch.int64)

        def hook(_module, args):
            x = args[0].reshape(-1, k).to(torch.float32)
            self._add(key, 0, x, x.shape[0])

        self.handles.append(module.register_forward_pre_hook(hook))

    def _wrap_experts(self, path: str, module, keys: set[str], experts) -> None:
        gate_up, down = module.gate_up_proj, module.down_proj
        e_count, two_i, hidden = gate_up.shape
        if down.shape != (e_count, hidden, two_i // 2):
            raise QuantError(f"GPTQ: {path} has gate_up_proj {list(gate_up.shape)} and down_proj "
                             f"{list(down.shape)}; expected [E, 2I, H] and [E, H, I] (transformers' fused layout)")
        active = sorted(set(range(e_count)) if experts is None else set(experts))
        slot = {e: i for i, e in enumerate(active)}
        want_gu, want_down = f"{path}.gate_up_proj" in keys, f"{path}.down_proj" in keys
        dev = gate_up.device
        for key, k in ((f"{path}.gate_up_proj", hidden), (f"{path}.down_proj", two_i // 2)):
            if key in keys:
                self.hessians[key] = torch.zeros(len(active), k, k, dtype=torch.float32, device=dev)
                self.tokens[key] = torch.zeros(len(active), dtype=torch.int64)
        self.slots = getattr(self, "slots", {})
        self.slots[path] = active
        original = module.forward
        gated = getattr(module, "_apply_gate", None) or _act_times_up(module)

        def forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs):
            with torch.no_grad():
                x_all = hidden_states.reshape(-1, hidden)
                routed = top_k_index.reshape(x_all.shape[0], -1)
                for e in active:
                    tokens = (routed == e).any(dim=-1).nonzero().view(-1)
                    if tokens.numel() == 0:
                        continue
                    x = x_all.index_select(0, tokens).to(torch.float32)
                    if want_gu:
                        self._add(f"{path}.gate_up_proj", slot[e], x, tokens.numel())
                    if want_down:
                        a = gated(torch.nn.functional.linear(x.to(gate_up.dtype), gate_up[e])).to(torch.float32)
                        self._add(f"{path}.down_proj", slot[e], a, tokens.numel())
            return original(hidden_states, top_k_index, top_k_weights, *args, **kwargs)

        module.forward = forward
        self.restore.append((path, module))

    def expert_slots(self, path: str) -> list[int]:
        return self.slots[path]

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        for _, module in self.restore:
            del module.forward  # the instance attribute goes; the class's forward is back
        self.handles, self.restore = [], []
