"""Turning a quantized checkpoint back into plain BF16 that transformers loads on any machine.

This is how the eval stage runs MXFP4 and FP8 checkpoints on a CPU (weights emulated exactly, activations in
BF16), and how tests compare a quantized model's logits with the original. It reads the formats this tool
writes and the common ones it reads: Quark MXFP4 (U8 weight + U8 weight_scale), Quark FP8 (F8_E4M3 weight +
F32 weight_scale, per-tensor or per-channel), Quark MXFP8 (F8_E4M3 weight + U8 weight_scale per 32 inputs) and
official block FP8 (weight_scale_inv).
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from quant.checkpoint import INDEX_FILE, load_tensors, open_checkpoint
from quant.errors import QuantError
from quant.numerics import fp8, mxfp4, mxfp8

SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale", ".output_scale")


def dequantize_module(weight: torch.Tensor, scales: dict[str, torch.Tensor], name: str,
                      dtype: torch.dtype) -> torch.Tensor:
    """One module's weight from its stored tensors (`scales`: suffix -> tensor): a quantized one decoded to `dtype`,
    an unquantized one as stored."""
    if "weight_scale_inv" in scales:
        return fp8.dequantize_fp8_block(weight, scales["weight_scale_inv"], dtype=dtype)
    scale = scales.get("weight_scale")
    if scale is None:
        if weight.dtype in (torch.uint8, torch.float8_e4m3fn):
            raise QuantError(f"tensor {name} is {weight.dtype} but has no weight_scale")
        # An unquantized weight is copied as stored: an F32 router or convolution (GLM-5.3-Flash's mlp.gate,
        # q/k/v_conv1d) cast to BF16 here would no longer be what the checkpoint means.
        return weight
    if weight.dtype == torch.uint8:
        return mxfp4.dequantize_mxfp4(weight, scale, dtype=dtype)
    if weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.uint8:  # MXFP8: E8M0 bytes per 32 inputs
        return mxfp8.dequantize_mxfp8(weight, scale, dtype=dtype)
    if weight.dtype == torch.float8_e4m3fn:
        return fp8.dequantize_fp8(weight, scale, dtype=dtype)
    raise QuantError(f"tensor {name}: cannot dequantize a {weight.dtype} weight with a weight_scale")


def dequantize_state(tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Dequantize every module whose weight and scales are all in `tensors`; scale tensors are dropped."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIXES):
            continue
        if name.endswith(".weight"):
            module = name[: -len(".weight")]
            scales = {s[1:]: tensors[module + s] for s in SCALE_SUFFIXES if module + s in tensors}
            out[name] = dequantize_module(t, scales, name, dtype)
        else:
            out[name] = t
    return out


def dequantize_checkpoint(src: str | Path, out: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a plain copy of `src`: quantized weights decoded to `dtype` (default BF16), every other tensor as stored;
    same tensor names, no quantization_config."""
    src, out = Path(src), Path(out)
    ckpt = open_checkpoint(src)
    ckpt.require_intact()
    if src.resolve() == out.resolve():
        raise QuantError(f"{out}: refusing to overwrite the source checkpoint")
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, file in enumerate(ckpt.files):
        names = [t.name for t in ckpt.shard_tensors(file)]
        # Scales may sit in another shard than their weight: fetch them from wherever the index says.
        extra = [m + s for n in names if n.endswith(".weight") for m in [n[: -len(".weight")]]
                 for s in SCALE_SUFFIXES if m + s in ckpt.tensors and ckpt.tensors[m + s].file != file]
        tensors = load_tensors(ckpt.shard_path(file), names)
        for name in extra:
            tensors.update(load_tensors(ckpt.shard_path(ckpt.tensors[name].file), [name]))
        plain = {k: v.contiguous() for k, v in dequantize_state(tensors, dtype).items() if k in names}
        shard = f"model-{i + 1:05d}-of-{len(ckpt.files):05d}.safetensors"
        save_file(plain, str(out / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in plain})
    with open(out / INDEX_FILE, "w") as f:
        json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    config = {k: v for k, v in ckpt.config.items() if k != "quantization_config"}
    config["dtype"] = str(dtype).replace("torch.", "")
    with open(out / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", INDEX_FILE) \
                and not f.name.startswith("."):
            shutil.copy2(f, out / f.name)
    return out



# --------------------------------------------------------------------------------- activations as engines run them
# The dequantized copy holds every quantized weight's exact value, but a plain transformers forward feeds each
# linear its BF16 input. Where the checkpoint's scheme also quantizes activations (Quark `input_tensors`, the
# block-FP8 format's dynamic activation scheme), `emulate_activations` quantizes and dequantizes each such linear's
# input the way the scheme says, with this package's numerics (quant.numerics), before the BF16 matmul: the
# emulation amd-quark runs on a machine without MX kernels (QParamsLinear: QDQ of the input, then F.linear).

ACTIVATION_MODES = ("emulate", "bf16")
# What an activation format is called in reports.
ACTIVATION_LABELS = {"mxfp4": "MXFP4", "mxfp8": "MXFP8", "fp8-token": "FP8 per token",
                     "fp8-group": "FP8 per token-group"}
_EXPERT_PROJ = {"gate_proj": "gate_up", "up_proj": "gate_up", "w1": "gate_up", "w3": "gate_up",
                "down_proj": "down", "w2": "down"}


@dataclass(frozen=True)
class ActivationFormat:
    """How a linear's input is quantized: `kind` (a key of ACTIVATION_LABELS), the MX scale rule, the FP8 group."""

    kind: str
    scale_mode: str = "even"
    group: int = 0  # fp8-group: elements per group along the input dimension

    @property
    def label(self) -> str:
        return ACTIVATION_LABELS[self.kind] + (f" {self.group}" if self.kind == "fp8-group" else "")


def qdq_activation(x: torch.Tensor, fmt: ActivationFormat) -> torch.Tensor:
    """Quantize-dequantize `x` [..., K] along its last dimension as `fmt` says; returns x's dtype and shape.

    mxfp4 / mxfp8: blocks of 32 with an E8M0 scale (quant.numerics.mxfp4 / mxfp8, Quark's "even" scale by default);
    fp8-token: one FP8 E4M3 scale (amax / 448) per token; fp8-group: one per `group` consecutive inputs of a token
    (DeepSeek's dynamic per-token-group activation quantization), both by quant.numerics.fp8's per-row rule."""
    if x.numel() == 0:
        return x
    if x.dtype == torch.float64:  # an eval run in float64: the quantizers take float32 (engines feed bf16)
        return qdq_activation(x.to(torch.float32), fmt).to(torch.float64)
    if fmt.kind == "mxfp4":
        packed, scales = mxfp4.quantize_mxfp4(x, fmt.scale_mode)
        return mxfp4.dequantize_mxfp4(packed, scales, dtype=x.dtype)
    if fmt.kind == "mxfp8":
        q, scales = mxfp8.quantize_mxfp8(x, fmt.scale_mode)
        return mxfp8.dequantize_mxfp8(q, scales, dtype=x.dtype)
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if fmt.kind == "fp8-group":
        width = -(-k // fmt.group) * fmt.group  # zero padding leaves a partial group's amax its own
        rows = torch.nn.functional.pad(rows, (0, width - k)).reshape(-1, fmt.group)
    q, scale = fp8.quantize_fp8_per_channel(rows)
    out = fp8.dequantize_fp8(q, scale, dtype=x.dtype)
    if fmt.kind == "fp8-group":
        out = out.reshape(-1, width)[:, :k]
    return out.reshape(x.shape)


def _input_format(spec, where: str) -> ActivationFormat | None:
    """A Quark `input_tensors` spec -> its format; None for unquantized inputs; QuantError for what is not modelled."""
    if isinstance(spec, list):  # two-stage specs: modelled only when the stage is one
        if len(spec) != 1:
            raise QuantError(f"{where}: a {len(spec)}-stage activation spec; --activations emulate models one "
                             "stage (use --activations bf16)")
        spec = spec[0]
    if not spec:
        return None
    dtype, qscheme = spec.get("dtype"), spec.get("qscheme")
    mode = spec.get("scale_calculation_mode") or "even"
    mx = {"fp4": ("mxfp4", mxfp4.SCALE_MODES), "fp8_e4m3": ("mxfp8", mxfp8.SCALE_MODES)}.get(dtype)
    if mx and qscheme == "per_group" and spec.get("group_size") == 32 \
            and (dtype == "fp4" or spec.get("scale_format") == "e8m0"):
        if mode not in mx[1]:
            raise QuantError(f"{where}: activation scale rule {mode!r} is not modelled by --activations emulate "
                             "(use --activations bf16)")
        return ActivationFormat(mx[0], mode)
    if dtype == "fp8_e4m3" and spec.get("is_dynamic") and qscheme in ("per_channel", "per_token"):
        return ActivationFormat("fp8-token")
    raise QuantError(f"{where}: activations {dtype} {qscheme} ({'dynamic' if spec.get('is_dynamic') else 'static'})"
                     " are not modelled by --activations emulate (use --activations bf16)")


def _quark_layer_config(q: dict, module: str) -> tuple[str, dict]:
    for pattern, cfg in (q.get("layer_quant_config") or {}).items():
        if fnmatch.fnmatch(module, pattern):
            return f"layer_quant_config[{pattern!r}]", cfg or {}
    linear = (q.get("layer_type_quant_config") or {}).get("Linear")
    if linear:
        return "layer_type_quant_config['Linear']", linear
    return "global_quant_config", q.get("global_quant_config") or {}


def activation_formats(ckpt) -> dict[str, ActivationFormat]:
    """{module: format} for every linear the checkpoint stores quantized (its weight has a scale) and whose input
    its quantization_config quantizes: Quark's `input_tensors` (layer_quant_config by fnmatch, as amd-quark and the
    engines match it, else global_quant_config), or block FP8's `activation_scheme: dynamic` (per-token groups as
    wide as a weight block's input side). Empty for weight-only schemes and unquantized checkpoints."""
    q = ckpt.config.get("quantization_config") or {}
    method = q.get("quant_method")
    quantized = [name[: -len(".weight")] for name in ckpt.tensors
                 if name.endswith(".weight") and any(name[: -len(".weight")] + s in ckpt.tensors
                                                     for s in (".weight_scale", ".weight_scale_inv"))]
    formats = {}
    if method == "fp8":
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise QuantError(f"quantization_config.activation_scheme {q.get('activation_scheme')!r}: static block-FP8 "
                             "activations are not modelled by --activations emulate (use --activations bf16)")
        group = int((q.get("weight_block_size") or [128, 128])[-1])
        return {m: ActivationFormat("fp8-group", group=group) for m in quantized
                if m + ".weight_scale_inv" in ckpt.tensors}
    if method != "quark":
        return formats
    for module in quantized:
        where, cfg = _quark_layer_config(q, module)
        fmt = _input_format(cfg.get("input_tensors"), f"quantization_config.{where} (for {module})")
        if fmt is not None:
            formats[module] = fmt
    return formats


def _runtime_names(module: str) -> list[str]:
    """The names transformers may give a checkpoint module: as stored, and with the language model's prefix of
    a vision-language wrapper added or dropped."""
    prefixes = ("model.language_model.", "language_model.model.", "model.", "language_model.")
    names = [module]
    for old in prefixes:
        if module.startswith(old):
            rest = module[len(old):]
            names += [new + rest for new in prefixes if new != old]
            break
    return names


def _qdq_input_hook(fmt: ActivationFormat):
    def hook(module, args, kwargs):
        if args:
            return (qdq_activation(args[0], fmt), *args[1:]), kwargs
        key = "hidden_states" if "hidden_states" in kwargs else "input"
        return args, {**kwargs, key: qdq_activation(kwargs[key], fmt)}

    return hook


def _wrap_gate(module, fmt: ActivationFormat) -> None:
    """transformers' fused experts (grouped_mm / batched_mm) feed `self._apply_gate(gate_up)` to down_proj."""
    gate = module._apply_gate

    module._apply_gate = lambda gate_up: qdq_activation(gate(gate_up), fmt)


def _in_transformers_layer(name: str, spec: dict | None) -> str:
    """Checkpoint module `name` as transformers names it within its decoder layer (the family's
    `transformers_layer` data: MiniMax-M2's block_sparse_moe.experts.E.w1 is mlp.experts.E.gate_proj, a part of
    transformers' fused experts; MiniMax-M3's mlp.gate_proj and mlp.up_proj are transformers' mlp.gate_up_proj,
    whose input is theirs)."""

    found = re.match(r"(.*\blayers\.\d+\.)(.+)$", name) if spec else None
    if found is None:
        return name
    head, rest = found.groups()
    rest += "."  # the renames are prefixes of parameter keys ("self_attn.index_k_proj." -> "self_attn.indexer.k_proj.")
    for ours, theirs in spec.get("renames", {}).items():
        if rest.startswith(ours):
            rest = theirs + rest[len(ours):]
            break
    rest = rest[:-1]
    path, _, leaf = rest.rpartition(".")
    if re.search(r"\.\d+$", path) and leaf in spec.get("expert_projs", {}):
        return f"{head}{path}.{spec['expert_projs'][leaf]}"
    for fused, parts in spec.get("fused_linears", {}).items():
        if leaf in parts:
            return f"{head}{path}.{fused}" if path else f"{head}{fused}"
    return head + rest


def emulate_activations(model, formats: dict[str, ActivationFormat], num_hidden_layers: int | None = None,
                        layer_names: dict | None = None) -> dict:
    """Hook `model` (transformers, loaded from the dequantized copy) so each module in `formats` gets its input
    quantize-dequantized. nn.Linear modules get a forward pre-hook; routed experts that transformers fuses into one
    module (gate_up_proj / down_proj parameters) get their input (the gate_up input, the same for every expert)
    and their `_apply_gate` output (the down_proj input) quantize-dequantized. Modules of MTP layers (index at or
    beyond `num_hidden_layers`), which transformers does not build, are skipped. `layer_names`: the family's
    `transformers_layer` data, for the families whose decoder layer transformers names otherwise. Returns {format
    label: modules hooked}; QuantError for a module that cannot be hooked, or experts that run transformers' eager
    loop."""

    modules = dict(model.named_modules())
    hooked: dict[str, int] = {}
    linears: dict[int, ActivationFormat] = {}
    fused: dict[str, dict[str, ActivationFormat]] = {}
    for name, fmt in formats.items():
        layer = re.search(r"layers\.(\d+)\.", name)
        if num_hidden_layers is not None and layer and int(layer.group(1)) >= num_hidden_layers:
            continue  # an MTP layer: not part of transformers' model
        name = _in_transformers_layer(name, layer_names)
        found = next((modules[n] for n in _runtime_names(name) if n in modules), None)
        if isinstance(found, torch.nn.Linear):
            if linears.setdefault(id(found), fmt) != fmt:  # the parts of one fused linear
                raise QuantError(f"{name}: its parts' activations are quantized differently; transformers runs them "
                                 "as one linear (use --activations bf16)")
            if not getattr(found, "_quant_qdq_hooked", False):  # a fused linear's input once, not once per part
                found.register_forward_pre_hook(_qdq_input_hook(fmt), with_kwargs=True)
                found._quant_qdq_hooked = True
            hooked[fmt.label] = hooked.get(fmt.label, 0) + 1
            continue
        expert = re.match(r"(.*)\.\d+\.(\w+)$", name)
        parent = next((n for n in _runtime_names(expert.group(1)) if n in modules), None) if expert else None
        if parent is None or expert.group(2) not in _EXPERT_PROJ or not hasattr(modules[parent], "_apply_gate"):
            raise QuantError(f"{name}: its activations are quantized, but transformers' model has no linear or fused "
                             "experts module of that name to emulate them on (use --activations bf16)")
        slot = fused.setdefault(parent, {})
        role = _EXPERT_PROJ[expert.group(2)]
        if slot.setdefault(role, fmt) != fmt:
            raise QuantError(f"{expert.group(1)}: experts with different activation formats; transformers runs them "
                             "as one fused module (use --activations bf16)")
        hooked[fmt.label] = hooked.get(fmt.label, 0) + 1
    for parent, roles in fused.items():
        experts_impl = getattr(getattr(modules[parent], "config", None), "_experts_implementation", None)
        if experts_impl not in ("grouped_mm", "batched_mm"):
            raise QuantError(f"{parent}: fused experts run transformers' {experts_impl or 'eager'} loop, where their "
                             "activations cannot be emulated (use --activations bf16)")
        if "gate_up" in roles:
            modules[parent].register_forward_pre_hook(_qdq_input_hook(roles["gate_up"]), with_kwargs=True)
        if "down" in roles:
            _wrap_gate(modules[parent], roles["down"])
    return hooked
