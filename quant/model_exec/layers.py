"""The checkpoint's decoder stack, one layer at a time, as transformers builds it from config.json (GPTQ's
calibration runs it; `quant quantize --dry-run` sizes the model `config_model` builds).

`DecoderStack` builds the family's model on the meta device (no memory), keeps the embedding (loaded from the
source) and replaces every decoder layer by a recorder. One pass of the model's own forward over the calibration
windows then yields the first layer's inputs and the keyword arguments the model hands each layer (attention
masks of each layer's type, rotary embeddings, position ids), so masks and positions are made by transformers'
code, not ours. `load_layer(i)` then materialises the real layer i alone, from the source shards, and
`forward(i, ...)` runs it over every batch to make the next layer's inputs.

What a layer returns besides its hidden states, and which argument of the next layer that feeds, is family data
(`decoder_layer.returns` in quant/manifests/families/*.yaml).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from quant.checkpoint import SCALE_INV, Checkpoint, Source, SourceReader
from quant.errors import QuantError
from quant.families import (
    family_for_config,
    text_prefix,  # the language model's tensor prefix, per family data
)
from quant.sources import native
from quant.sources.native import read_values

PER_EXPERT = re.compile(r"^(?P<experts>.*\bexperts)\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")
PROJS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LayerNames:
    """Checkpoint names within a decoder layer <-> transformers' (family data `transformers_layer`: MiniMax-M2's
    block_sparse_moe.experts.E.w1/w3/w2 are transformers' mlp.experts gate_up_proj / down_proj; MiniMax-M3's
    mlp.gate_proj and mlp.up_proj are the row halves of transformers' mlp.gate_up_proj linear)."""

    renames: tuple[tuple[str, str], ...] = ()  # (checkpoint prefix, transformers prefix)
    projs: tuple[tuple[str, str], ...] = ()  # (checkpoint expert leaf, gate_proj | up_proj | down_proj)
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (transformers linear, checkpoint linears in row order)

    @classmethod
    def of(cls, ckpt: Checkpoint) -> "LayerNames":
        return cls.of_family(family_for_config(ckpt.config, ckpt.root / "config.json"))

    @classmethod
    def of_family(cls, family) -> "LayerNames":
        spec = family.transformers_layer
        return cls(tuple(spec["renames"].items()), tuple(spec["expert_projs"].items()),
                   tuple((k, tuple(v)) for k, v in spec.get("fused_linears", {}).items()))

    def fused_parts(self, key: str) -> list[str] | None:
        """The checkpoint names (relative to the layer) whose rows transformers' linear weight `key` concatenates,
        in order; None when `key` is no fused linear of the family."""
        path, _, leaf = key.rpartition(".")
        module_path, _, module = path.rpartition(".")
        if leaf != "weight":
            return None
        for theirs, ours in self.fused:
            if module == theirs:
                stem = self.checkpoint(f"{module_path}.{theirs}.weight" if module_path else f"{theirs}.weight")
                base = stem[:-len(f"{theirs}.weight")]
                return [f"{base}{part}.weight" for part in ours]
        return None

    def fused_of(self, rest: str) -> tuple[str, list[str]] | None:
        """For a checkpoint linear `rest` (transformers' naming, relative to the layer) that is one part of a fused
        linear: (the fused linear's weight key, its parts' transformers keys in order); None otherwise."""
        path, _, leaf = rest.rpartition(".")
        module_path, _, module = path.rpartition(".")
        if leaf != "weight":
            return None
        stem = f"{module_path}." if module_path else ""
        for theirs, ours in self.fused:
            if module in ours:
                return f"{stem}{theirs}.weight", [f"{stem}{part}.weight" for part in ours]
        return None

    def checkpoint(self, key: str) -> str:
        """The checkpoint's name (relative to the layer) of transformers' layer key."""
        for ours, theirs in self.renames:
            if key.startswith(theirs):
                return ours + key[len(theirs):]
        return key

    def transformers(self, rest: str) -> str:
        for ours, theirs in self.renames:
            if rest.startswith(ours):
                return theirs + rest[len(ours):]
        return rest

    def leaf(self, proj: str) -> str:
        """The checkpoint's per-expert leaf for gate_proj / up_proj / down_proj."""
        return next((ours for ours, theirs in self.projs if theirs == proj), proj)

    def proj(self, leaf: str) -> str | None:
        return dict(self.projs).get(leaf, leaf if leaf in PROJS else None)


@dataclass(frozen=True)
class Slot:
    """Where a checkpoint weight lives in the transformers layer: parameter `key` (relative to the layer), and
    for fused 3-D expert parameters the expert and row range."""

    key: str
    expert: int | None = None
    rows: tuple[int, int] | None = None


class _Recorder(torch.nn.Module):
    """Stands in for decoder layer `index` during the capture pass: keeps what the model passes it."""

    def __init__(self, index: int, returns: list[str], stack: "DecoderStack"):
        super().__init__()
        self.index, self.returns, self.stack = index, returns, [stack]

    def forward(self, hidden_states, *args, **kwargs):
        if args:
            raise QuantError(f"decoder layer {self.index}: positional arguments besides the hidden states are not "
                             f"supported ({len(args)} given)")
        self.stack[0].record(self.index, hidden_states, kwargs)
        if len(self.returns) == 1:
            return hidden_states
        return (hidden_states, *(kwargs.get(name) for name in self.returns[1:]))


def row_shards(tensors, name: str) -> list[str]:
    """The checkpoint's row shards of transformers' parameter `name` (`<module>.weight` stored as
    `<module>.shard_0.weight`, `.shard_1.weight`, ...: transformers' Concatenate(dim=0) checkpoint converter, e.g.
    Qwen4-Exp's PLE n-gram tables, conversion_mapping.py "qwen4_exp_text"), in order; [] when it is not sharded."""
    if not name.endswith(".weight"):
        return []
    stem, shards = name[: -len(".weight")], []
    while f"{stem}.shard_{len(shards)}.weight" in tensors:
        shards.append(f"{stem}.shard_{len(shards)}.weight")
    return shards


def _unsupported(ckpt: Checkpoint, why: str) -> QuantError:
    family = family_for_config(ckpt.config, ckpt.root / "config.json").name
    return QuantError(f"--method gptq does not support {family} checkpoints yet: {why}; round to nearest "
                      f"(--method rtn, the default) works")


def config_model(root: Path, dtype: torch.dtype = torch.float32, unsupported=None) -> torch.nn.Module:
    """transformers' causal LM built from `root`/config.json alone, on the meta device (no memory, no weights:
    what `meta_model` checks against a checkpoint, and what `quant quantize --dry-run` sizes). For a
    vision-language wrapper AutoModelForCausalLM has no model for, the causal LM of its text config that the
    family data names (`transformers_layer.text_model`: Kimi-K2.5's DeepseekV3ForCausalLM), so the decoder is the
    text model alone and the vision tower is never built. `unsupported(why)` makes the error for a config
    transformers has no causal LM for."""

    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING


    unsupported = unsupported or (lambda why: QuantError(f"--method gptq cannot run this checkpoint: {why}"))
    try:
        config = AutoConfig.from_pretrained(root)
    except Exception as e:
        raise QuantError(f"{root / 'config.json'}: transformers cannot build a config from it "
                         f"({str(e).splitlines()[0][:160]})") from None
    build = AutoModelForCausalLM.from_config
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        no_model = (f"transformers' AutoModelForCausalLM has no model for {type(config).__name__} "
                    f"(model_type {config.model_type})")
        family = family_for_config(json.loads((root / "config.json").read_text()), root / "config.json")
        name = family.transformers_layer.get("text_model")
        if not name:
            raise unsupported(f"{no_model} and the family data names no text model to build instead "
                              f"(transformers_layer.text_model in {family.file.name if family.file else 'its file'})")
        cls = getattr(transformers, name, None)
        text = config.get_text_config()
        if cls is None:
            raise unsupported(f"{no_model}, and transformers {transformers.__version__} has no {name} (the family's "
                              f"transformers_layer.text_model)")
        if isinstance(config, cls.config_class):
            # the wrapper itself (GLM-5.3-Flash: no causal LM of its text config exists); its get_decoder() is the
            # text model, and the vision tower, built on the meta device, is never materialised or run
            build = cls._from_config
        elif text is config or not isinstance(text, cls.config_class):
            raise unsupported(f"{no_model}, and its text config ({type(text).__name__}) is not the "
                              f"{cls.config_class.__name__} that {name} (transformers_layer.text_model) builds from")
        else:
            config, build = text, cls._from_config
    try:
        with torch.device("meta"):
            return build(config, dtype=dtype)
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        raise unsupported(f"transformers cannot build the model from config.json "
                          f"({str(e).splitlines()[0][:160]})") from None


def meta_model(root: Path, ckpt: Checkpoint, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers' causal LM for the checkpoint's config.json, on the meta device (no memory), after checking
    that every decoder layer it builds can be read from the checkpoint's tensors; a family where it cannot (a
    vision-language wrapper AutoModelForCausalLM has no model for, tensor names transformers only maps while
    loading) is one QuantError naming the family, before any work."""

    if native.is_microscaled(ckpt):  # DecoderStack.read takes BF16 or block FP8 (quant.sources decodes the rest)
        raise _unsupported(ckpt, "its weights arrive microscaled (MXFP4 / NVFP4 / MXFP8 / FP8 codes with block "
                                 "scales, or a Quark export), which GPTQ's layer reader does not decode")
    model = config_model(root, dtype, lambda why: _unsupported(ckpt, why))
    prefix = text_prefix(ckpt.tensors)
    names = LayerNames.of(ckpt)
    for index, layer in enumerate(model.get_decoder().layers):
        for key, _ in list(layer.named_parameters()) + list(layer.named_buffers()):  # what load_layer reads
            name = f"{prefix}layers.{index}.{names.checkpoint(key)}"
            if name in ckpt.tensors or row_shards(ckpt.tensors, name):
                continue
            parts = names.fused_parts(key)
            if parts and all(f"{prefix}layers.{index}.{part}" in ckpt.tensors for part in parts):
                continue
            if key.endswith("experts.gate_up_proj") or key.endswith("experts.down_proj"):
                base = name.rsplit(".", 1)[0]
                projs = ("gate_proj", "up_proj") if key.endswith("gate_up_proj") else ("down_proj",)
                count = layer.get_parameter(key).shape[0]
                if all(f"{base}.{e}.{names.leaf(p)}.weight" in ckpt.tensors for e in range(count) for p in projs):
                    continue
            raise _unsupported(ckpt, f"transformers' decoder layer {index} has {key}, which the checkpoint does not "
                                     f"store as {name} (its tensors are named differently, a mapping transformers "
                                     f"applies only when it loads the whole model)")
    return model


def materialize(module: torch.nn.Module, device: str) -> None:
    """Give a module built on the meta device empty storage on `device`, and rebuild its rotary embeddings (their
    buffers are computed in __init__, lost on the meta device); the parameters are then filled by the caller."""
    module.to_empty(device=device)
    for name, child in list(module.named_modules()):
        if name.endswith("rotary_emb"):
            parent = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
            setattr(parent, name.rsplit(".", 1)[-1], type(child)(child.config).to(device))


class DecoderStack:
    """The decoder layers of `ckpt`, built by transformers from its config.json, run one at a time."""

    def __init__(self, root: Path, ckpt: Checkpoint, returns: list[str], device: str, dtype: torch.dtype,
                 model: torch.nn.Module | None = None):
        self.ckpt, self.device, self.dtype, self.returns = ckpt, device, dtype, returns
        self.reader = SourceReader(ckpt, device)
        self.prefix = text_prefix(ckpt.tensors)
        self.names = LayerNames.of(ckpt)
        model = model if model is not None else meta_model(root, ckpt, dtype)
        self.text = model.get_decoder()
        self.layers = list(self.text.layers)
        self.text.layers = torch.nn.ModuleList(_Recorder(i, returns, self) for i in range(len(self.layers)))
        materialize(self.text, device)
        with torch.no_grad(), self.reader.hashing() as digest:
            for key, param in self.text.named_parameters():
                param.copy_(self.read(self.prefix + key))
        # What each load read, by content (the sha256 of the tensors' stored bytes): a resumed GPTQ run reuses a
        # layer's solution only when everything it was made from is the same bytes (quant.gptq.run).
        self.identity: dict = {"text": digest()}
        self.first_inputs: list[torch.Tensor] = []
        self.kwargs: dict[int, dict[int, dict]] = {}  # layer -> batch size -> kwargs

    def __len__(self) -> int:
        return len(self.layers)

    def read(self, name: str) -> torch.Tensor:
        info = self.ckpt.tensors.get(name)
        if info is None:
            raise QuantError(f"{self.ckpt.root}: tensor {name} is missing (the decoder layer transformers builds "
                             f"from config.json needs it)")
        scale = name + SCALE_INV
        scale_info = self.ckpt.tensors.get(scale) if info.dtype == "F8_E4M3" else None
        src = Source(name, info.file, scale if scale_info else None, scale_info.file if scale_info else None)

        return read_values(self.reader, src)

    # -- the capture pass ------------------------------------------------------------------------------------
    def record(self, index: int, hidden: torch.Tensor, kwargs: dict) -> None:
        if index == 0:
            self.first_inputs.append(hidden.detach())
        self.kwargs.setdefault(index, {}).setdefault(hidden.shape[0], {
            k: v for k, v in kwargs.items() if k not in self.returns[1:]})

    @torch.no_grad()
    def capture(self, tokens: torch.Tensor, batch: int) -> list[torch.Tensor]:
        """Run the model's forward over the windows [N, L] in batches; returns the first layer's inputs."""
        for b in range(0, tokens.shape[0], batch):
            self.text(input_ids=tokens[b:b + batch].to(self.device), use_cache=False)
        inputs, self.first_inputs = self.first_inputs, []
        return inputs

    def layer_kwargs(self, index: int, batch_size: int) -> dict:
        return self.kwargs[index][batch_size]

    # -- one layer -------------------------------------------------------------------------------------------
    def slot(self, index: int, tensor: str, expert: int | None, rows: tuple[int, int] | None) -> Slot:
        """Where checkpoint tensor `tensor` (optionally a fused slice) of layer `index` sits in the layer."""
        rest = self.names.transformers(tensor[len(f"{self.prefix}layers.{index}."):])
        if expert is not None:
            return Slot(rest, expert, rows)
        m = PER_EXPERT.match(rest)
        proj = self.names.proj(m.group("proj")) if m else None
        if proj is None:
            return self._fused_slot(index, rest)
        key = f"{m.group('experts')}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
        try:
            height = self.layers[index].get_parameter(key).shape[1]
        except AttributeError:
            raise QuantError(f"{self.ckpt.root}: tensor {tensor}: the transformers layer has no fused expert "
                             f"parameter {key}") from None
        if proj == "down_proj":
            return Slot(key, int(m.group("e")), (0, height))
        lo = 0 if proj == "gate_proj" else height // 2
        return Slot(key, int(m.group("e")), (lo, lo + height // 2))

    def _fused_slot(self, index: int, rest: str) -> Slot:
        """A plain linear, or its rows in the fused linear transformers builds in its place (family data
        `fused_linears`: MiniMax-M3's gate_proj / up_proj in gate_up_proj)."""
        fused = self.names.fused_of(rest)
        if fused is None:
            return Slot(rest)
        params = dict(self.layers[index].named_parameters())
        if rest in params or fused[0] not in params:
            return Slot(rest)
        key, parts = fused
        start, layer = 0, f"{self.prefix}layers.{index}."
        for part in parts:
            info = self.ckpt.tensors.get(layer + self.names.checkpoint(part))
            if info is None:
                raise QuantError(f"{self.ckpt.root}: tensor {layer + self.names.checkpoint(part)} is missing (part "
                                 f"of {key}, which the decoder layer transformers builds concatenates)")
            if part == rest:
                return Slot(key, None, (start, start + info.shape[0]))
            start += info.shape[0]
        return Slot(rest)  # unreachable: rest is one of the parts

    def load_layer(self, index: int) -> torch.nn.Module:
        """Decoder layer `index` with its source weights (block-FP8 dequantized), in the compute dtype; the sha256
        of the bytes read goes to `identity[index]`."""
        with self.reader.hashing() as digest:
            layer = self._load_layer(index)
        self.identity[index] = digest()
        return layer

    def _load_layer(self, index: int) -> torch.nn.Module:
        layer = self.layers[index].to_empty(device=self.device)
        prefix = f"{self.prefix}layers.{index}."
        with torch.no_grad():
            for key, param in list(layer.named_parameters()) + list(layer.named_buffers()):
                name = prefix + self.names.checkpoint(key)
                parts = self.names.fused_parts(key)
                if name in self.ckpt.tensors:
                    value = self.read(name)
                elif parts and all(prefix + part in self.ckpt.tensors for part in parts):
                    value = torch.cat([self.read(prefix + part) for part in parts])
                elif row_shards(self.ckpt.tensors, name):
                    value = torch.cat([self.read(shard) for shard in row_shards(self.ckpt.tensors, name)])
                elif key.endswith("experts.gate_up_proj") or key.endswith("experts.down_proj"):
                    value = self._stack_experts(prefix, self.names.checkpoint(key), tuple(param.shape))
                else:
                    raise QuantError(f"{self.ckpt.root}: tensor {name} is missing (decoder layer {index} as "
                                     f"transformers builds it from config.json)")
                if tuple(value.shape) != tuple(param.shape):
                    raise QuantError(f"{self.ckpt.root}: tensor {name} is {list(value.shape)}, the decoder layer "
                                     f"built from config.json needs {list(param.shape)}")
                param.copy_(value)
        return layer.eval()

    def _stack_experts(self, prefix: str, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A fused [E, ...] expert parameter from per-expert tensors (gate_up_proj = cat(gate, up) per expert)."""
        base = prefix + key.rsplit(".", 1)[0]
        out = torch.empty(shape, dtype=self.dtype, device=self.device)
        for e in range(shape[0]):
            leaf = self.names.leaf
            if key.endswith("gate_up_proj"):
                out[e] = torch.cat([self.read(f"{base}.{e}.{leaf('gate_proj')}.weight"),
                                    self.read(f"{base}.{e}.{leaf('up_proj')}.weight")])
            else:
                out[e] = self.read(f"{base}.{e}.{leaf('down_proj')}.weight")
        return out

    def run_layer(self, index: int, layer: torch.nn.Module, hidden: list, carry: list[dict]):
        """Layer `index` (`layer`, loaded) over every batch of `hidden` with the batch's carried keyword arguments:
        yields (batch, what the layer returns)."""
        for b, x in enumerate(hidden):
            out = layer(x, **self.layer_kwargs(index, x.shape[0]), **carry[b])
            yield b, out

    def forward(self, index: int, layer: torch.nn.Module, hidden: list, carry: list[dict]) -> tuple[list, list[dict]]:
        """The layer's outputs for every batch: the next layer's hidden states and carried keyword arguments."""
        new_hidden, new_carry = [], []
        for _, out in self.run_layer(index, layer, hidden, carry):
            if isinstance(out, tuple):
                new_hidden.append(out[0])
                new_carry.append(dict(zip(self.returns[1:], out[1:])))
            else:
                new_hidden.append(out)
                new_carry.append({})
        return new_hidden, new_carry

    def release_layer(self, index: int) -> None:
        self.layers[index] = None  # its memory goes; the stack never runs it again
