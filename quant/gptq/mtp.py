"""The MTP / NextN draft layers for GPTQ: built and fed the way the engines run them (evals/mtp_draft.py), so their
quantized weights can be solved after the main decoder layers.

transformers never runs these layers, but their inputs are known once the main layers are done: for draft layer
k at position t, the target's hidden state after its final norm (the calibration windows' activations, through
the already quantized main layers) and the embedding of token t+k+1, as `evals.mtp_draft._DraftLayer` takes them
(DeepSeek-V3 / GLM-5: embedding zeroed at position 0, `eh_proj(cat[enorm(e), hnorm(h)])`, then one decoder
layer and the draft's final norm). Layer k > 0 is fed layer k-1's output in place of the target's hidden state,
as the engines chain their draft steps. The glue (enorm, hnorm, eh_proj, shared_head) is BF16 in every recipe,
so what GPTQ solves is the decoder layer inside, exactly like a main layer: its Hessians are collected while
the draft runs over the calibration windows.

The decoder layer is the family's own transformers decoder layer built from config.json as a one-layer model
(`evals.mtp_draft._one_layer_config`: a MoE layer of the MTP layer's attention type) on the meta device, then
materialised alone from the source shards (block-FP8 sources dequantized, as for the main layers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quant.errors import QuantError


@dataclass(frozen=True)
class MtpLayerRef:
    """Draft layer `k`: its checkpoint names (`evals.mtp_draft.DraftNames`)."""

    k: int
    names: object

    @property
    def block(self) -> str:
        return self.names.block

    def owns(self, tensor: str) -> bool:
        return tensor.startswith(self.names.block)


def mtp_layers(ckpt) -> list[MtpLayerRef]:
    """The checkpoint's MTP draft layers (family data `mtp_draft`); [] when the family or checkpoint has none
    (MiniMax-M2's config counts MTP modules its release never published: nothing to solve there either)."""
    from evals.mtp_draft import draft_layers
    from quant.families import family_for_config

    try:
        layers = draft_layers(ckpt.config, ckpt.tensors)
    except QuantError:
        if family_for_config(ckpt.config).unpublished_mtp(ckpt.config, ckpt.tensors):
            return []
        raise
    return [MtpLayerRef(k, names) for k, names in enumerate(layers)]


class _StackReader:
    """`evals.mtp_draft._block_state`'s reader interface over the GPTQ stack's reader (FP8 sources dequantized)."""

    def __init__(self, stack):
        self.stack, self.root = stack, stack.ckpt.root

    def __contains__(self, name: str) -> bool:
        return name in self.stack.ckpt.tensors

    def get(self, name: str) -> torch.Tensor:
        return self.stack.read(name)


class MtpBlock:
    """One MTP draft layer on the stack's device and dtype: `layer` is its decoder layer (what GPTQ solves, its
    parameters named as in a main layer), `inputs` makes its decoder inputs from a batch of windows and `run`
    runs the decoder layer and the draft's final norm over them."""

    def __init__(self, stack, ref: MtpLayerRef):
        from transformers import AutoConfig, AutoModelForCausalLM

        from evals.mtp_draft import _block_state, _one_layer_config
        from quant.families import family_for_config, text_config

        self.ref, self.stack = ref, stack
        names = ref.names
        device, dtype = stack.device, stack.dtype
        spec = family_for_config(stack.ckpt.config).mtp_draft
        cfg = _one_layer_config(AutoConfig.from_pretrained(stack.ckpt.root), spec.get("decoder_config") or {})
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        decoder = model.get_decoder()
        decoder.embed_tokens = None  # fed inputs_embeds; the embedding is read once below
        decoder.to_empty(device=device)
        for name, module in list(decoder.named_modules()):
            if name.endswith("rotary_emb"):  # buffers computed in __init__, lost on the meta device
                parent = decoder.get_submodule(name.rsplit(".", 1)[0]) if "." in name else decoder
                setattr(parent, name.rsplit(".", 1)[-1], type(module)(module.config).to(device))
        reader = _StackReader(stack)
        keys = {k: tuple(v.shape) for k, v in decoder.state_dict().items()}
        state = _block_state(keys, names, reader)
        state["norm.weight"] = reader.get(names.final_norm + ".weight")
        with torch.no_grad():
            params = dict(decoder.named_parameters())
            params.update(dict(decoder.named_buffers()))
            for key, value in state.items():
                params[key].copy_(value)
            missing = [k for k in params if k not in state and not k.endswith("inv_freq")]
            if missing:
                raise QuantError(f"{stack.ckpt.root}: MTP layer {names.block}: cannot fill {missing[:3]}")
        self.decoder = decoder.eval()
        self.layer = decoder.layers[0]
        eps = text_config(stack.ckpt.config).get("rms_norm_eps", 1e-6)
        hidden = cfg.hidden_size
        norm_cls = type(decoder.norm)
        self.embed_norm = norm_cls(hidden, eps=eps).to(device=device, dtype=dtype)
        self.hidden_norm = norm_cls(hidden, eps=eps).to(device=device, dtype=dtype)
        self.proj = torch.nn.Linear(2 * hidden, hidden, bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            for module, name in ((self.embed_norm, names.embed_norm), (self.hidden_norm, names.hidden_norm),
                                 (self.proj, names.proj)):
                weight = reader.get(name + ".weight")
                if tuple(weight.shape) != tuple(module.weight.shape):
                    raise QuantError(f"{stack.ckpt.root}: MTP tensor {name}.weight is {list(weight.shape)}, "
                                     f"expected {list(module.weight.shape)}")
                module.weight.copy_(weight)
        own_embed = getattr(stack.text, "embed_tokens", None)
        if names.embed == f"{stack.prefix}embed_tokens" and own_embed is not None:
            self.embed = own_embed.weight  # the model's own, already on the device
        else:
            self.embed = reader.get(names.embed + ".weight").to(device=device, dtype=dtype)
        self.zero_position_0 = names.zero_embedding_at_position_0

    def inputs(self, next_tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(z, positions) of the decoder for `next_tokens` [B, L] (x[t+k+1]) and `hidden` [B, L, H] at t: as
        `evals.mtp_draft._DraftLayer.forward`."""
        e = torch.nn.functional.embedding(next_tokens.to(self.embed.device), self.embed)
        positions = torch.arange(next_tokens.shape[1], device=e.device).expand(next_tokens.shape[0], -1)
        if self.zero_position_0:
            e = torch.where((positions == 0).unsqueeze(-1), torch.zeros_like(e), e)
        z = self.proj(torch.cat([self.embed_norm(e), self.hidden_norm(hidden.to(e.dtype))], dim=-1))
        return z, positions

    def run(self, z: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The draft's output (after its final norm: what the next draft step is fed)."""
        return self.decoder(inputs_embeds=z, position_ids=positions, use_cache=False).last_hidden_state

    def slot(self, tensor: str, expert: int | None = None, rows: tuple[int, int] | None = None):
        """Where checkpoint tensor `tensor` (optionally a fused slice) of the block sits in `layer` (as
        `DecoderStack.slot`)."""
        from quant.gptq.layers import PER_EXPERT, Slot

        rest = tensor[len(self.ref.block):]
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
