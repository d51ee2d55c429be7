"""The MTP (multi-token-prediction) draft head of a checkpoint, run in process the way SGLang and vLLM run it for
speculative decoding. transformers builds the model without its MTP layers; this module builds them from the
checkpoint's own tensors.

Where the layers are stored and how the engines wire them is family data (`mtp_draft` in
quant/manifests/families/*.yaml, each with the engine source it was read from). For draft layer k, with `h` the
target's hidden state after its final norm at position t and x[t+1] the token after it:

    e = embed_norm(embed(x[t+1]))          (DeepSeek/GLM: the embedding is zeroed at position 0)
    z = proj(cat[e, hidden_norm(h)])
    out = final_norm(block(z))             (block: one decoder layer, its residual added)
    logits = head(out)                     (draft for x[t+2]); `out` is the hidden fed to the next draft step

The decoder block is the family's own transformers decoder layer (a one-layer model built from config.json, as a
MoE layer of the MTP layer's attention type), loaded with the MTP layer's weights; its final norm is the draft's
final norm. Per-expert tensors are stacked into transformers' fused expert parameters where the module has them.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

from quant.errors import QuantError


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
    """The MTP draft layers a checkpoint stores, per the family data; [] when it has none."""
    from quant.families import family_for_config, text_config

    family = family_for_config(config)
    spec = family.mtp_draft
    if not spec:
        return []
    text = text_config(config)
    count_key = spec.get("count_key") or (family.mtp or {}).get("count_key")
    count = text.get(count_key) or 0 if count_key else 0
    first = text.get((family.mtp or {}).get("first_layer_key", ""), 0) or 0
    names = set(tensor_names)
    prefix = _text_prefix(names)
    layers = []
    for k in range(int(count)):
        block = spec["block"].format(text=prefix, n=int(first) + k, k=k)

        def resolve(template: str) -> str:
            return template.format(block=block, text=prefix)

        def first_stored(templates: list[str], what: str) -> str:
            for t in templates:
                if resolve(t) + ".weight" in names:
                    return resolve(t)
            raise QuantError(f"MTP layer {k}: no {what} tensor ({', '.join(resolve(t) + '.weight' for t in templates)})")

        if not any(n.startswith(block) for n in names):
            # MiniMax: the config counts MTP modules the release never published (family data mtp_unpublished)
            raise QuantError(family.unpublished_mtp(config, names)
                             or f"config.json declares {count} MTP layer(s) ({count_key}) but no tensor starts with "
                                f"{block}")
        layers.append(DraftNames(
            block=block, embed_norm=resolve(spec["embed_norm"]), hidden_norm=resolve(spec["hidden_norm"]),
            proj=resolve(spec["proj"]), final_norm=resolve(spec["final_norm"]),
            embed=first_stored(spec["embed"], "embedding"), head=first_stored(spec["head"], "output head"),
            glue=tuple(spec.get("glue") or ()), zero_embedding_at_position_0=bool(spec.get(
                "zero_embedding_at_position_0")),
        ))
    return layers


def _one_layer_config(hf_config, overrides: dict):
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


class _Reader:
    """Tensors of a safetensors checkpoint by name (headers via quant.checkpoint)."""

    def __init__(self, root: Path):
        from quant.checkpoint import open_checkpoint

        self.ckpt = open_checkpoint(root)
        self.root = Path(root)

    def __contains__(self, name: str) -> bool:
        return name in self.ckpt.tensors

    def get(self, name: str):
        from safetensors import safe_open

        if name not in self.ckpt.tensors:
            raise QuantError(f"{self.root}: MTP tensor {name} is missing")
        with safe_open(str(self.ckpt.shard_path(self.ckpt.tensors[name].file)), framework="pt") as f:
            return f.get_tensor(name)


def _block_state(target_keys: dict, names: DraftNames, reader: _Reader) -> dict:
    """State for the one-layer model's `layers.0.*` from the MTP block's tensors (per-expert tensors stacked into
    fused ones where the module is fused: gate_up_proj [E, 2I, H] = cat(gate, up) per expert, down_proj
    [E, H, I])."""
    import torch

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
    """The inverse of `_block_state`: checkpoint tensors of the MTP block from a one-layer model's state, named
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


def load_draft(root: Path, *, dtype=None, device: str = "cpu"):
    """The checkpoint's MTP draft (an `MtpDraft`), or None when the family has no MTP layers or the checkpoint
    stores none. `root` must be an unquantized (or dequantized) checkpoint."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from quant.families import family_for_config, text_config

    root = Path(root)
    reader = _Reader(root)
    config = json.loads((root / "config.json").read_text())
    layers = draft_layers(config, reader.ckpt.tensors)
    if not layers:
        return None
    dtype = dtype or torch.bfloat16
    spec = family_for_config(config).mtp_draft
    cfg = _one_layer_config(AutoConfig.from_pretrained(root), spec.get("decoder_config") or {})
    eps = text_config(config).get("rms_norm_eps", 1e-6)
    heads = []
    for names in layers:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        decoder = model.get_decoder()
        keys = {k: tuple(v.shape) for k, v in decoder.state_dict().items()}
        state = _block_state(keys, names, reader)
        state["norm.weight"] = reader.get(names.final_norm + ".weight")
        state["embed_tokens.weight"] = reader.get(names.embed + ".weight")
        missing, unexpected = decoder.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.endswith("inv_freq")]
        if missing or unexpected:
            raise QuantError(f"{root}: MTP layer {names.block}: cannot fill {missing[:3] or unexpected[:3]}")
        norm_cls = type(decoder.norm)
        hidden = cfg.hidden_size
        head = _DraftLayer(decoder, norm_cls(hidden, eps=eps), norm_cls(hidden, eps=eps),
                           torch.nn.Linear(2 * hidden, hidden, bias=False),
                           torch.nn.Linear(hidden, cfg.vocab_size, bias=False), names.zero_embedding_at_position_0)
        with torch.no_grad():
            for module, name in ((head.embed_norm, names.embed_norm), (head.hidden_norm, names.hidden_norm),
                                 (head.proj, names.proj), (head.head, names.head)):
                weight = reader.get(name + ".weight")
                if tuple(weight.shape) != tuple(module.weight.shape):
                    raise QuantError(f"{root}: MTP tensor {name}.weight is {list(weight.shape)}, expected "
                                     f"{list(module.weight.shape)}")
                module.weight.copy_(weight)
        heads.append(head.to(dtype=dtype))
        del model.lm_head
    return MtpDraft(heads).to(device).eval()


def _module_base():
    import torch

    return torch.nn.Module


class _DraftLayer(_module_base()):
    def __init__(self, decoder, embed_norm, hidden_norm, proj, head, zero_position_0: bool):
        super().__init__()
        self.decoder, self.embed_norm, self.hidden_norm, self.proj, self.head = (decoder, embed_norm, hidden_norm,
                                                                                 proj, head)
        self.zero_position_0 = zero_position_0

    def forward(self, next_tokens, hidden, positions, attention_mask=None):
        """(out, logits) for inputs [B, L]: next_tokens = x[t+1], hidden = the hidden state at t, positions = t;
        `attention_mask` [B, 1, L, L] additive (default causal)."""
        import torch

        e = self.decoder.embed_tokens(next_tokens)
        if self.zero_position_0:
            e = torch.where((positions == 0).unsqueeze(-1), torch.zeros_like(e), e)
        z = self.proj(torch.cat([self.embed_norm(e), self.hidden_norm(hidden.to(e.dtype))], dim=-1))
        out = self.decoder(inputs_embeds=z, position_ids=positions, attention_mask=attention_mask,
                           use_cache=False).last_hidden_state
        return out, self.head(out)


class MtpDraft(_module_base()):
    """The MTP draft layers; step j of a chain uses layer j % len(layers), as vLLM's DeepSeekMultiTokenPredictor
    and Qwen3_5MultiTokenPredictor do (spec_step_idx % num_mtp_layers)."""

    def __init__(self, layers):
        import torch

        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, step: int, next_tokens, hidden, positions, attention_mask=None):
        return self.layers[step % len(self.layers)](next_tokens, hidden, positions, attention_mask)
