"""The MTP (multi-token-prediction) draft layers of a checkpoint, built from its own tensors and run the way SGLang
and vLLM run them for speculative decoding. transformers builds the model without its MTP layers.

Where the layers are stored and how the engines wire them is family data (`mtp_draft` in
quant/manifests/families/*.yaml, each with the engine source it was read from). For draft layer k, with `h` the
target's hidden state after its final norm at position t and x[t+1] the token after it:

    e = embed_norm(embed(x[t+1]))          (DeepSeek/GLM: the embedding is zeroed at position 0)
    z = proj(cat[e, hidden_norm(h)])
    out = final_norm(block(z))             (block: one decoder layer, its residual added)
    logits = head(out)                     (draft for x[t+2]); `out` is the hidden fed to the next draft step

That forward is `DraftLayer` (`inputs` makes z, `run` the block and its final norm), built two ways:
  - `load_draft`: the whole draft (glue, block, head) in memory from an unquantized (or dequantized) checkpoint,
    for the eval's acceptance measurement (evals/arms/mtp_draft.py, evals/arms/mtp_measure.py);
  - `MtpBlock`: the block and its input glue on a `DecoderStack`'s device and dtype, read through its reader
    (block-FP8 sources dequantized), for GPTQ's solve of the MTP layer after the main layers (quant.gptq.run).
The block is the family's own transformers decoder layer (`one_layer_config`: a one-layer model built from
config.json, as a MoE layer of the MTP layer's attention type), loaded with the MTP layer's weights
(`block_state`: per-expert tensors stacked into transformers' fused expert parameters where the module has them);
its final norm is the draft's final norm.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from quant.checkpoint import open_checkpoint
from quant.errors import QuantError
from quant.families import family_for_config, mtp_layout, text_config
from quant.model_exec.layers import PER_EXPERT, Slot, materialize


@dataclass(frozen=True)
class DraftNames:
    """Checkpoint tensor names of one MTP draft layer (module names; `.weight` is appended)."""

    block: str             # prefix of the decoder layer's tensors
    embed_norm: str
    hidden_norm: str
    proj: str
    final_norm: str
    embed: str
    head: str
    glue: tuple[str, ...]  # first name parts under `block` that are not the decoder layer's
    zero_embedding_at_position_0: bool


def _text_prefix(tensor_names) -> str:
    return "model.language_model." if any(n.startswith("model.language_model.") for n in tensor_names) else "model."


def draft_layers(config: dict, tensor_names) -> list[DraftNames]:
    """The MTP draft layers a checkpoint stores, per its MTP layout (`quant.families.mtp_layout`); [] when it has
    none."""
    mtp = _layout(config)
    names = set(tensor_names)
    unpublished = mtp.unpublished_line(names)
    if unpublished:  # MiniMax: the config counts MTP modules the release never published
        raise QuantError(unpublished)
    draft = mtp.draft
    if draft is None:
        return []
    if draft.unsupported:  # the family publishes MTP layers whose block transformers cannot build
        raise QuantError(f"the {mtp.family} MTP draft cannot be run in process ({draft.unsupported}); "
                         "run without MTP (--no-mtp)")
    prefix = _text_prefix(names)
    layers = []
    for k in range(mtp.count):
        block = mtp.block(k, prefix)
        resolve = partial(_resolve, block=block, text=prefix)
        first_stored = partial(_first_stored, resolve=resolve, names=names, k=k)
        if not any(n.startswith(block) for n in names):
            raise QuantError(f"config.json declares {mtp.count} MTP layer(s) ({mtp.count_key}) but no tensor starts "
                             f"with {block}")
        layers.append(DraftNames(
            block=block, embed_norm=resolve(draft.embed_norm), hidden_norm=resolve(draft.hidden_norm),
            proj=resolve(draft.proj), final_norm=resolve(draft.final_norm),
            embed=first_stored(draft.embed, "embedding"), head=first_stored(draft.head, "output head"),
            glue=draft.glue, zero_embedding_at_position_0=draft.zero_embedding_at_position_0,
        ))
    return layers



def _resolve(template: str, block: str, text: str) -> str:
    return template.format(block=block, text=text)


def _first_stored(templates: tuple[str, ...], what: str, resolve, names: set[str], k: int) -> str:
    """The first of `templates` (resolved for draft layer k) whose weight the checkpoint stores."""
    for t in templates:
        if resolve(t) + ".weight" in names:
            return resolve(t)
    tried = ", ".join(resolve(t) + ".weight" for t in templates)
    raise QuantError(f"MTP layer {k}: no {what} tensor ({tried})")

def one_layer_config(hf_config, overrides: dict):
    """The text config with one decoder layer: per-layer lists keep their last entry (the MTP layer is built like
    the last main layer), then the family's overrides (a MoE layer, the MTP's attention type)."""
    cfg = copy.deepcopy(hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config)
    layers = cfg.num_hidden_layers
    for key, value in list(vars(cfg).items()):
        if isinstance(value, list) and len(value) == layers and key != "architectures":
            setattr(cfg, key, value[-1:])
    cfg.num_hidden_layers = 1
    for key, value in overrides.items():
        setattr(cfg, key, copy.deepcopy(value))
    return cfg


def draft_config(root: Path, mtp):
    """`one_layer_config` of the checkpoint at `root` with its MTP layout `mtp`'s draft `decoder_config`
    overrides: the config of the one-layer model whose decoder layer is the MTP block."""
    from transformers import AutoConfig

    return one_layer_config(AutoConfig.from_pretrained(root), dict(mtp.draft.decoder_config))


def _layout(config: dict):
    """The checkpoint's MTP layout, by its config's family (which must be known: the draft is family data)."""

    return mtp_layout(config, family_for_config(config))


class CheckpointTensors:
    """Tensors of a safetensors checkpoint by name (headers via quant.checkpoint), as stored."""

    def __init__(self, root: Path):
        self.ckpt = open_checkpoint(root)
        self.root = Path(root)

    def __contains__(self, name: str) -> bool:
        return name in self.ckpt.tensors

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.ckpt.tensors:
            raise QuantError(f"{self.root}: MTP tensor {name} is missing")
        with safe_open(str(self.ckpt.shard_path(self.ckpt.tensors[name].file)), framework="pt") as f:
            return f.get_tensor(name)


class StackTensors:
    """The tensors of a `DecoderStack`'s checkpoint through the stack's reader (block-FP8 sources dequantized)."""

    def __init__(self, stack):
        self.stack, self.root = stack, stack.ckpt.root

    def __contains__(self, name: str) -> bool:
        return name in self.stack.ckpt.tensors

    def get(self, name: str) -> torch.Tensor:
        return self.stack.read(name)


def block_state(target_keys: dict, names: DraftNames, reader) -> dict:
    """State for the one-layer model's `layers.0.*` from the MTP block's tensors (per-expert tensors stacked into
    fused ones where the module is fused: gate_up_proj [E, 2I, H] = cat(gate, up) per expert, down_proj
    [E, H, I]). `reader`: `CheckpointTensors` or `StackTensors`."""
    state = {}
    for key, shape in target_keys.items():
        if not key.startswith("layers.0."):
            continue
        rest = key[len("layers.0."):]
        source = names.block + rest
        if source in reader:
            state[key] = reader.get(source)
        elif rest.endswith("mlp.experts.gate_up_proj") or rest.endswith("mlp.experts.down_proj"):
            base = names.block + rest.rsplit(".", 1)[0]
            experts = shape[0]
            if rest.endswith("gate_up_proj"):
                state[key] = torch.stack([torch.cat([reader.get(f"{base}.{e}.gate_proj.weight"),
                                                     reader.get(f"{base}.{e}.up_proj.weight")]) for e in
                                          range(experts)])
            else:
                state[key] = torch.stack([reader.get(f"{base}.{e}.down_proj.weight") for e in range(experts)])
        else:
            raise QuantError(f"{reader.root}: MTP tensor {source} is missing (the {names.block}* decoder layer)")
        if tuple(state[key].shape) != tuple(shape):
            raise QuantError(f"{reader.root}: MTP tensor {source} is {list(state[key].shape)}, the decoder layer "
                             f"built from config.json needs {list(shape)}")
    return state


def block_tensors(decoder_state: dict, names: DraftNames, stored: dict) -> dict:
    """The inverse of `block_state`: checkpoint tensors of the MTP block from a one-layer model's state, named
    and laid out like `stored` (the checkpoint's own names and shapes under `names.block`, glue excluded)."""
    out = {}
    for name, like in stored.items():
        rest = name[len(names.block):]
        key = "layers.0." + rest
        if key in decoder_state:
            out[name] = decoder_state[key]
            continue
        parts = rest.split(".")  # mlp.experts.{e}.{gate,up,down}_proj.weight
        fused = "layers.0." + ".".join(parts[:2]) + (".down_proj" if parts[3] == "down_proj" else ".gate_up_proj")
        expert = decoder_state[fused][int(parts[2])]
        rows = like.shape[0]
        out[name] = {"gate_proj": expert[:rows], "up_proj": expert[rows:], "down_proj": expert}[parts[3]]
    return out


def _load_weights(modules: list[tuple[torch.nn.Module, str]], reader) -> None:
    """Copy each checkpoint tensor `name`.weight into `module.weight`, its shape checked."""
    with torch.no_grad():
        for module, name in modules:
            weight = reader.get(name + ".weight")
            if tuple(weight.shape) != tuple(module.weight.shape):
                raise QuantError(f"{reader.root}: MTP tensor {name}.weight is {list(weight.shape)}, expected "
                                 f"{list(module.weight.shape)}")
            module.weight.copy_(weight)


class DraftLayer(torch.nn.Module):
    """One MTP draft layer: `decoder` (a one-layer transformers decoder: its `embed_tokens` is the draft's
    embedding, `layers[0]` the block, `norm` the final norm), the glue (`embed_norm`, `hidden_norm`, `proj`) and
    the output head (None where only the block's output is needed)."""

    def __init__(self, decoder, embed_norm, hidden_norm, proj, head, zero_position_0: bool):
        super().__init__()
        self.decoder, self.embed_norm, self.hidden_norm, self.proj, self.head = (decoder, embed_norm, hidden_norm,
                                                                                 proj, head)
        self.zero_position_0 = zero_position_0

    def inputs(self, next_tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(z, positions): the block's input for `next_tokens` [B, L] (x[t+1]) and `hidden` [B, L, H] at t;
        `positions` t default to 0..L-1."""
        embed = self.decoder.embed_tokens
        e = embed(next_tokens.to(embed.weight.device))
        if positions is None:
            positions = torch.arange(next_tokens.shape[1], device=e.device).expand(next_tokens.shape[0], -1)
        if self.zero_position_0:
            e = torch.where((positions == 0).unsqueeze(-1), torch.zeros_like(e), e)
        z = self.proj(torch.cat([self.embed_norm(e), self.hidden_norm(hidden.to(e.dtype))], dim=-1))
        return z, positions

    def run(self, z: torch.Tensor, positions: torch.Tensor, attention_mask=None) -> torch.Tensor:
        """The block and the final norm over z: the draft's output (what the next draft step is fed)."""
        return self.decoder(inputs_embeds=z, position_ids=positions, attention_mask=attention_mask,
                            use_cache=False).last_hidden_state

    def forward(self, next_tokens, hidden, positions, attention_mask=None):
        """(out, logits) for inputs [B, L]: next_tokens = x[t+1], hidden = the hidden state at t, positions = t;
        `attention_mask` [B, 1, L, L] additive (default causal)."""
        out = self.run(*self.inputs(next_tokens, hidden, positions), attention_mask)
        return out, self.head(out)


class MtpDraft(torch.nn.Module):
    """The MTP draft layers; step j of a chain uses layer j % len(layers), as vLLM's DeepSeekMultiTokenPredictor
    and Qwen3_5MultiTokenPredictor do (spec_step_idx % num_mtp_layers)."""

    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, step: int, next_tokens, hidden, positions, attention_mask=None):
        return self.layers[step % len(self.layers)](next_tokens, hidden, positions, attention_mask)


def experts_options(dtype) -> dict:
    """from_pretrained/from_config options for `dtype`: torch's grouped_mm, transformers' default for fused experts,
    has no float64 kernel; batched_mm (bmm) has."""
    return {"experts_implementation": "batched_mm"} if dtype == torch.float64 else {}


def load_draft(root: Path, *, dtype=None, device: str = "cpu") -> MtpDraft | None:
    """The checkpoint's MTP draft, or None when the family has no MTP layers or the checkpoint stores none.
    `root` must be an unquantized (or dequantized) checkpoint."""
    from transformers import AutoModelForCausalLM


    root = Path(root)
    reader = CheckpointTensors(root)
    config = json.loads((root / "config.json").read_text())
    layers = draft_layers(config, reader.ckpt.tensors)
    if not layers:
        return None
    dtype = dtype or torch.bfloat16
    cfg = draft_config(root, _layout(config))
    eps = text_config(config).get("rms_norm_eps", 1e-6)
    heads = []
    for names in layers:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, **experts_options(dtype))
        decoder = model.get_decoder()
        keys = {k: tuple(v.shape) for k, v in decoder.state_dict().items()}
        state = block_state(keys, names, reader)
        state["norm.weight"] = reader.get(names.final_norm + ".weight")
        state["embed_tokens.weight"] = reader.get(names.embed + ".weight")
        missing, unexpected = decoder.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.endswith("inv_freq")]
        if missing or unexpected:
            raise QuantError(f"{root}: MTP layer {names.block}: cannot fill {missing[:3] or unexpected[:3]}")
        norm_cls = type(decoder.norm)
        hidden = cfg.hidden_size
        head = DraftLayer(decoder, norm_cls(hidden, eps=eps), norm_cls(hidden, eps=eps),
                          torch.nn.Linear(2 * hidden, hidden, bias=False),
                          torch.nn.Linear(hidden, cfg.vocab_size, bias=False), names.zero_embedding_at_position_0)
        _load_weights([(head.embed_norm, names.embed_norm), (head.hidden_norm, names.hidden_norm),
                       (head.proj, names.proj), (head.head, names.head)], reader)
        heads.append(head.to(dtype=dtype))
        del model.lm_head
    return MtpDraft(heads).to(device).eval()


class MtpBlock:
    """MTP draft layer `names` of a `DecoderStack`'s checkpoint on the stack's device and dtype, without its head:
    `draft` (a `DraftLayer`) makes the block's inputs from a batch of windows (`inputs`) and runs the block and
    the final norm (`run`); `layer` is the block's decoder layer (what GPTQ solves, its parameters named as in a
    main layer) and `slot` places a checkpoint tensor of the block in it."""

    def __init__(self, stack, names: DraftNames):
        from transformers import AutoModelForCausalLM


        self.names, self.stack = names, stack
        device, dtype = stack.device, stack.dtype
        cfg = draft_config(stack.ckpt.root, _layout(stack.ckpt.config))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, **experts_options(dtype))
        decoder = model.get_decoder()
        decoder.embed_tokens = None  # fed inputs_embeds; the embedding is set below
        materialize(decoder, device)
        reader = StackTensors(stack)
        keys = {k: tuple(v.shape) for k, v in decoder.state_dict().items()}
        state = block_state(keys, names, reader)
        state["norm.weight"] = reader.get(names.final_norm + ".weight")
        with torch.no_grad():
            params = dict(decoder.named_parameters())
            params.update(dict(decoder.named_buffers()))
            for key, value in state.items():
                params[key].copy_(value)
            missing = [k for k in params if k not in state and not k.endswith("inv_freq")]
            if missing:
                raise QuantError(f"{stack.ckpt.root}: MTP layer {names.block}: cannot fill {missing[:3]}")
        own_embed = getattr(stack.text, "embed_tokens", None)
        if names.embed == f"{stack.prefix}embed_tokens" and own_embed is not None:
            weight = own_embed.weight  # the model's own, already on the device (shared, not copied)
        else:
            weight = reader.get(names.embed + ".weight").to(device=device, dtype=dtype)
        decoder.embed_tokens = torch.nn.Embedding.from_pretrained(weight)
        eps = text_config(stack.ckpt.config).get("rms_norm_eps", 1e-6)
        hidden = cfg.hidden_size
        norm_cls = type(decoder.norm)
        self.draft = DraftLayer(decoder.eval(), norm_cls(hidden, eps=eps).to(device=device, dtype=dtype),
                                norm_cls(hidden, eps=eps).to(device=device, dtype=dtype),
                                torch.nn.Linear(2 * hidden, hidden, bias=False, device=device, dtype=dtype), None,
                                names.zero_embedding_at_position_0)
        _load_weights([(self.draft.embed_norm, names.embed_norm), (self.draft.hidden_norm, names.hidden_norm),
                       (self.draft.proj, names.proj)], reader)
        self.layer = decoder.layers[0]

    def inputs(self, next_tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(z, positions) of the block for `next_tokens` [B, L] (x[t+k+1]) and `hidden` [B, L, H] at t."""
        return self.draft.inputs(next_tokens, hidden)

    def run(self, z: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The draft's output (after its final norm: what the next draft step is fed)."""
        return self.draft.run(z, positions)

    def slot(self, tensor: str, expert: int | None = None, rows: tuple[int, int] | None = None):
        """Where checkpoint tensor `tensor` (optionally a fused slice) of the block sits in `layer` (as
        `DecoderStack.slot`)."""

        rest = tensor[len(self.names.block):]
        if expert is not None:
            return Slot(rest, expert, rows)
        m = PER_EXPERT.match(rest)
        if m is None or m.group("proj") not in ("gate_proj", "up_proj", "down_proj"):
            return Slot(rest)
        key = f"{m.group('experts')}.{'down_proj' if m.group('proj') == 'down_proj' else 'gate_up_proj'}"
        try:
            height = self.layer.get_parameter(key).shape[1]
        except AttributeError:
            return Slot(rest)  # per-expert nn.Linear modules: the name is the parameter's
        if m.group("proj") == "down_proj":
            return Slot(key, int(m.group("e")), (0, height))
        lo = 0 if m.group("proj") == "gate_proj" else height // 2
        return Slot(key, int(m.group("e")), (lo, lo + height // 2))
