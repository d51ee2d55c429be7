"""`quant search SRC --dry-run`: what the streamed Fisher estimate (fisher.py) would cost, from config.json alone.

Nothing is read but config.json (no weights, no tokenizer, no calibration text) and nothing is written. The
decoder layers are the ones DecoderStack streams: transformers builds the model on the meta device
(`quant.model_exec.layers.config_model`, no memory), as `quant quantize --dry-run` sizes GPTQ
(quant.gptq.dry_run). Each layer's linears are named as the checkpoint names them (`LayerNames`), their units and
menus are the search's own (`units.search_units`, `menu.unit_menu`, the engine releases asked), computed on the
first layer of each kind (same parameter shapes) and applied to the layers like it.

With N windows of T tokens, A = N x T x hidden x 4 bytes (one layer's fp32 input, all windows):
  - memory: the forward pass keeps every layer's input (A, plus the carried returns: GLM-5's top-k indices) until
    the backward reaches it, and the last layer's output; the backward adds the gradient, the layer's output and
    the gradient below (3 A), one layer's weights in fp32 as DecoderStack builds it, a saved copy of the largest
    unit's weights while a choice is quantized (plus 3 of its largest single matrix: the clone, codes and
    dequantized values), and one batch's autograd activations, estimated as 2 x 4 bytes per active linear
    output element and twice the family's per-token forward workspace (decoder_layer.workspace_bytes_per_token)
    per batch token. The head phase holds the LM head in fp32 and about 3 x batch x T x vocab fp32 (logits, their
    log-softmax and its gradient). The embedding (fp32) is resident throughout.
  - compute, in forward-equivalent layer passes: 1 (forward) + 3 (backward: recompute and backward) + one per
    (unit, format) of the layer that quantizes something; FLOPs = 2 x active parameters x N x T per pass, active
    = every matrix of the layer, the routed experts' scaled by top-k / experts (what a token runs). The head adds
    2 passes of vocab x hidden. Not counted: attention's score products (T^2 terms; small at T = 128) and the
    quantize-dequantize of each choice's weights.
  - reads: each layer's stored bytes twice (forward and backward), the embedding and LM head once.
Not predicted: the process's fixed cost (torch, transformers: about 0.5 GB of host memory).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from quant.errors import QuantError
from quant.families import family_for_config, mtp_layout, text_config
from quant.gptq.dry_run import config_dir, family_expression, source_element_bytes
from quant.model_exec.layers import LayerNames, config_model
from quant.planning.recipes import TREATMENTS
from quant.planning.schemes import DEFAULT_SCHEME, get_scheme
from quant.search.menu import unit_menu
from quant.search.units import search_units
from quant.units import human

BACKWARD_PASSES = 3  # recompute with autograd and backward, in forward-equivalents
HEAD_PASSES = 2  # the head's forward and its backward to the last layer's output (its weight takes no gradient)
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k", "num_activated_experts", "n_activated_experts")


@dataclass
class LayerCost:
    index: int
    kind: str  # "dense" or "moe" and the layer's units ([attention, dense_mlp]; kinds alike in shapes share it)
    params: int  # every parameter of the layer
    active: int  # what one token runs (routed experts: top-k of them)
    weights_fp32: int  # bytes, as DecoderStack builds the layer (fp32 on CPU)
    stored: int  # bytes in the checkpoint
    units: int
    options: int  # (unit, format) choices that quantize something: one forward each
    largest_unit: int  # bytes (fp32) of the largest unit's weights, saved while a choice is tried
    largest_matrix: int  # bytes (fp32) of the largest single matrix quantized at once
    autograd: int  # bytes: one batch's activations under autograd (module docstring)

    @property
    def passes(self) -> int:
        return 1 + BACKWARD_PASSES + self.options


@dataclass
class SearchCost:
    config_path: str
    family: str
    windows: int
    seq_len: int
    batch: int
    hidden: int
    vocab: int
    engines: list[str]
    layers: list[LayerCost] = field(default_factory=list)
    act_bytes: int = 0  # A: one layer's input, all windows, fp32
    carry_bytes: int = 0  # the carried returns beside it
    resident: int = 0  # embedding and final norm, fp32
    head_bytes: int = 0  # the LM head in fp32 (the embedding when tied: already resident)
    head_working: int = 0
    head_stored: int = 0  # bytes read once: embedding, final norm, LM head

    @property
    def tokens(self) -> int:
        return self.windows * self.seq_len

    def layer_flops(self, layer: LayerCost) -> int:
        return 2 * layer.active * self.tokens * layer.passes

    def head_flops(self) -> int:
        return 2 * self.vocab * self.hidden * self.tokens * HEAD_PASSES

    def flops(self) -> int:
        return sum(self.layer_flops(layer) for layer in self.layers) + self.head_flops()

    def kept(self) -> int:
        """Every layer's input and the last layer's output, as the forward pass leaves them."""
        return (len(self.layers) + 1) * (self.act_bytes + self.carry_bytes)

    def backward_peak(self, layer: LayerCost) -> int:
        held = (layer.index + 2) * (self.act_bytes + self.carry_bytes)  # inputs not yet freed, the last output
        working = 3 * self.act_bytes + layer.weights_fp32 + layer.largest_unit + 3 * layer.largest_matrix
        return self.resident + held + working + layer.autograd

    def head_peak(self) -> int:
        return self.resident + self.kept() + self.head_bytes + self.head_working

    def forward_peak(self) -> int:
        return self.resident + self.kept() + max((layer.weights_fp32 for layer in self.layers), default=0)

    def peak(self) -> int:
        return max([self.forward_peak(), self.head_peak(), *(self.backward_peak(la) for la in self.layers)])

    def read_bytes(self) -> int:
        return 2 * sum(layer.stored for layer in self.layers) + self.head_stored

    def hours(self, flops_per_s: float) -> float:
        return self.flops() / flops_per_s / 3600

    def totals(self) -> dict:
        return {"layers": len(self.layers), "passes": sum(la.passes for la in self.layers),
                "options": sum(la.options for la in self.layers), "flops": self.flops(),
                "head_flops": self.head_flops(), "kept_inputs_bytes": self.kept(),
                "largest_layer_fp32_bytes": max((la.weights_fp32 for la in self.layers), default=0),
                "largest_autograd_bytes": max((la.autograd for la in self.layers), default=0),
                "resident_bytes": self.resident, "head_bytes": self.head_bytes + self.head_working,
                "peak_host_bytes": self.peak(), "read_bytes": self.read_bytes()}

    def as_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "layers"}
        out["layers"] = [{**asdict(la), "passes": la.passes, "flops": self.layer_flops(la)} for la in self.layers]
        out["kinds"] = [{"kind": kind, "layers": [la.index for la in group], **_kind_row(self, group[0]),
                         "backward_peak": max(self.backward_peak(la) for la in group)}
                        for kind, group in self.kinds().items()]
        out["totals"] = self.totals()
        return out

    def kinds(self) -> dict[str, list[LayerCost]]:
        groups: dict[str, list[LayerCost]] = {}
        for layer in self.layers:
            groups.setdefault(layer.kind, []).append(layer)
        return groups


def _kind_row(cost: SearchCost, layer: LayerCost) -> dict:
    return {"params": layer.params, "active": layer.active, "weights_fp32": layer.weights_fp32,
            "units": layer.units, "options": layer.options, "passes": layer.passes,
            "flops": cost.layer_flops(layer), "stored": layer.stored, "autograd": layer.autograd}


def _top_k(cfg: dict, layer) -> int | None:
    for key in TOP_K_KEYS:
        if isinstance(cfg.get(key), int):
            return int(cfg[key])
    for module in layer.modules():  # a layer that keeps it on its router
        for key in ("top_k", "num_experts_per_tok"):
            if isinstance(getattr(module, key, None), int):
                return int(getattr(module, key))
    return None


def _linears(layer, base: str, names: LayerNames) -> tuple[dict[str, tuple[int, int]], dict[str, str]]:
    """Checkpoint module -> (numel, in_features) for every matrix DecoderStack's layer holds as an nn.Linear or a
    fused [E, ...] expert parameter, named as the checkpoint names it (as quant.gptq.dry_run._plan_layer does);
    and transformers' key -> "routed" / "linear"."""
    import torch

    modules = dict(layer.named_modules())
    out: dict[str, tuple[int, int]] = {}
    keys: dict[str, str] = {}
    for key, param in layer.named_parameters():
        path, name = key.rsplit(".", 1) if "." in key else ("", key)
        module = modules.get(path)
        if isinstance(module, torch.nn.Linear) and name == "weight":
            parts = names.fused_parts(key) or [names.checkpoint(key)]
            rows = param.shape[0] // len(parts)
            for part in parts:
                out[base + part[:-len(".weight")]] = (rows * param.shape[1], int(param.shape[1]))
            keys[key] = "linear"
        elif name in ("gate_up_proj", "down_proj") and param.dim() == 3:
            stem = base + names.checkpoint(f"{path}.")[:-1]
            projs = ("gate_proj", "up_proj") if name == "gate_up_proj" else ("down_proj",)
            for e in range(param.shape[0]):
                for p in projs:
                    out[f"{stem}.{e}.{names.leaf(p)}"] = (param[0].numel() // len(projs), int(param.shape[-1]))
            keys[key] = "routed"
    return out, keys


def search_cost(src: str | Path, *, samples: int = 32, seq_len: int = 128, engines: list[str] | None = None,
                batch: int = 8, scale_mode: str = "even") -> SearchCost:
    """The cost of `fisher_losses` over `samples` windows of `seq_len` tokens (see the module docstring)."""
    import torch

    from quant.search.run import _treatment_rule
    from quant.verify import readable_profiles

    if samples < 1 or seq_len < 2:
        raise QuantError(f"--calib-samples {samples} --calib-seq-len {seq_len}: at least 1 window of 2 tokens")
    root, config = config_dir(str(src))
    family = family_for_config(config, root / "config.json")
    cfg = text_config(config)
    mtp = mtp_layout(config, family)
    scheme_of = _treatment_rule(family, get_scheme(DEFAULT_SCHEME), mtp)
    profiles, _ = readable_profiles(config, engines)
    meta: Any = config_model(root, torch.float32,
                             lambda why: QuantError(f"the streamed estimate cannot run {family.name}: {why}"))
    text = meta.get_decoder()
    hidden, vocab = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    batch = min(batch, samples)
    values = {**{k: v for k, v in cfg.items() if isinstance(v, int) and not isinstance(v, bool)},
              "seq_len": seq_len, "dtype_bytes": 4}
    carry_exprs = family.layer_memory.get("carry_bytes_per_token") or {}
    workspace_expr = family.layer_memory.get("workspace_bytes_per_token")
    workspace = family_expression(workspace_expr, values, "workspace_bytes_per_token") if workspace_expr else 0
    elt = source_element_bytes(config)
    outside = sum(p.numel() for n, p in text.named_parameters() if not n.startswith("layers."))
    tied = bool(cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    cost = SearchCost(config_path=str(root / "config.json"), family=family.name, windows=samples, seq_len=seq_len,
                      batch=batch, hidden=hidden, vocab=vocab, engines=[p.label for p in profiles])
    cost.act_bytes = samples * seq_len * hidden * 4
    cost.carry_bytes = sum(
        samples * seq_len * family_expression(carry_exprs[name], values, f"carry_bytes_per_token.{name}")
        for name in family.layer_returns[1:] if name in carry_exprs)
    cost.resident = outside * 4
    cost.head_bytes = 0 if tied else vocab * hidden * 4
    cost.head_working = 3 * batch * seq_len * vocab * 4
    cost.head_stored = (outside + (0 if tied else vocab * hidden)) * elt
    names = LayerNames.of_family(family)
    prefix = family.text_prefixes[0]
    top_k = _top_k(cfg, text.layers[-1])
    seen: dict[tuple, LayerCost] = {}
    for index, layer in enumerate(text.layers):
        shapes = tuple((k, tuple(p.shape)) for k, p in layer.named_parameters())
        like = seen.get(shapes)
        if like is None:
            like = seen[shapes] = _layer_cost(index, layer, f"{prefix}layers.{index}.", names, family, scheme_of,
                                              profiles, config, scale_mode, mtp, top_k, elt, workspace,
                                              batch * seq_len)
            if any(other.kind == like.kind for key, other in seen.items() if key != shapes):
                like.kind += f" #{len(seen)}"  # same units, other shapes: a kind of its own
        cost.layers.append(LayerCost(**{**asdict(like), "index": index}))
    return cost


def _layer_cost(index: int, layer, base: str, names: LayerNames, family, scheme_of, profiles, config: dict,
                scale_mode: str, mtp, top_k: int | None, elt: int, workspace: int, batch_tokens: int) -> LayerCost:
    linears, keys = _linears(layer, base, names)
    quantizable = {m: v for m, v in linears.items() if family.role_of(m) is not None
                   and any(scheme_of(m, t) is not None for t in TREATMENTS)}
    roles = {m: family.role_of(m) or "" for m in quantizable}
    units = [u for u in search_units(quantizable, roles, list(mtp.decoder_layers), profiles) if not u.mtp]
    in_features = {m: v[1] for m, v in quantizable.items()}
    options, largest_unit, largest_matrix = 0, 0, 0
    for unit in units:
        menu = unit_menu(unit, TREATMENTS, scheme_of, in_features, profiles, config, scale_mode)
        options += sum(any(scheme_of(m, t) is not None for m in unit.modules) for t in menu)
        largest_unit = max(largest_unit, 4 * sum(quantizable[m][0] for m in unit.modules))
        largest_matrix = max([largest_matrix, *(4 * quantizable[m][0] for m in unit.modules)])
    params = active = outputs = 0
    routed = False
    for key, param in layer.named_parameters():
        params += param.numel()
        if param.dim() < 2:
            continue
        if keys.get(key) == "routed":
            routed = True
            if top_k is None:
                raise QuantError(f"{base}{key}: routed experts, but config.json names no experts per token "
                                 f"(one of {', '.join(TOP_K_KEYS)})")
            active += param[0].numel() * top_k
            outputs += param.shape[1] * top_k
        else:
            active += param.numel()
            outputs += param.shape[0]
    buffers = sum(b.numel() * b.element_size() for b in layer.buffers())
    kind = f"{'moe' if routed else 'dense'} [{', '.join(u.name.split(' ', 2)[2] for u in units)}]"
    return LayerCost(index=index, kind=kind, params=params, active=active, weights_fp32=params * 4 + buffers,
                     stored=params * elt, units=len(units), options=options, largest_unit=largest_unit,
                     largest_matrix=largest_matrix, autograd=batch_tokens * (2 * 4 * outputs + 2 * workspace))


def _count(n: float, unit: str = "") -> str:
    """1.23G (params), 171 TFLOP (with a unit)."""
    for prefix, size in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3), ("", 1)):
        if n >= size or not prefix:
            return f"{n / size:.3g}{prefix}" if not unit else f"{n / size:.3g} {prefix}{unit}"
    return ""


def render(cost: SearchCost, flops_per_s: dict[str, float] | None = None) -> list[str]:
    """The report: one line per kind of layer, then the totals (`flops_per_s`: label -> rate, for hours)."""
    t = cost.totals()
    lines = [f"quant search --dry-run: {cost.config_path} ({cost.family}), Fisher estimate over {cost.windows} "
             f"windows x {cost.seq_len} tokens (batch {cost.batch}), releases {', '.join(cost.engines)}"]
    for kind, group in cost.kinds().items():
        la = group[0]
        lines.append(f"  {kind} x{len(group)}: {_count(la.params)} params ({human(la.weights_fp32)} fp32), active "
                     f"{_count(la.active)}/token, {la.units} units {la.options} options -> {la.passes} passes, "
                     f"{_count(cost.layer_flops(la), 'FLOP')} each, reads {human(2 * la.stored)}, autograd "
                     f"{human(la.autograd)}"
                     f", peak {human(max(cost.backward_peak(x) for x in group))}")
    lines.append(f"  kept layer inputs {human(t['kept_inputs_bytes'])} ({human(cost.act_bytes + cost.carry_bytes)}"
                 f" a layer), largest layer {human(t['largest_layer_fp32_bytes'])} fp32, embedding "
                 f"{human(cost.resident)}, head {human(t['head_bytes'])}")
    lines.append(f"  total: {t['passes']} layer passes ({t['options']} options), {_count(t['flops'], 'FLOP')}, "
                 f"host peak {human(t['peak_host_bytes'])} (+ about 0.5 GB fixed), reads {human(t['read_bytes'])}")
    for label, rate in (flops_per_s or {}).items():
        lines.append(f"  at {_count(rate, 'FLOP/s')} ({label}): {cost.hours(rate):.3g} hours")
    return lines


def predict(src: str | Path, **kwargs) -> tuple[SearchCost, list[str]]:
    cost = search_cost(src, **kwargs)
    return cost, render(cost)


__all__ = ["SearchCost", "LayerCost", "search_cost", "render", "predict"]
