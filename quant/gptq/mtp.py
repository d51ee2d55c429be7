"""The MTP / NextN draft layers GPTQ solves after the main decoder layers, so their quantized weights are solved
like the main layers' instead of rounded to nearest.

transformers never runs these layers, but their inputs are known once the main layers are done: for draft layer
k at position t, the target's hidden state after its final norm (the calibration windows' activations, through
the already quantized main layers) and the embedding of token t+k+1, as the engines feed them
(`quant.model_exec.mtp.DraftLayer`: DeepSeek-V3 / GLM-5: embedding zeroed at position 0,
`eh_proj(cat[enorm(e), hnorm(h)])`, then one decoder layer and the draft's final norm). Layer k > 0 is fed layer
k-1's output in place of the target's hidden state, as the engines chain their draft steps. The glue (enorm,
hnorm, eh_proj, shared_head) is BF16 in every recipe, so what GPTQ solves is the decoder layer inside, exactly
like a main layer: its Hessians are collected while the draft runs over the calibration windows
(`quant.model_exec.mtp.MtpBlock`: the block built on the meta device and materialised alone from the source
shards, block-FP8 sources dequantized, as for the main layers).
"""

from __future__ import annotations

from dataclasses import dataclass

from quant.families import family_for_config, mtp_layout
from quant.model_exec.mtp import draft_layers


@dataclass(frozen=True)
class MtpLayerRef:
    """Draft layer `k`: its checkpoint names (`quant.model_exec.mtp.DraftNames`)."""

    k: int
    names: object

    @property
    def block(self) -> str:
        return self.names.block

    def owns(self, tensor: str) -> bool:
        return tensor.startswith(self.names.block)


def mtp_layers(ckpt) -> list[MtpLayerRef]:
    """The checkpoint's MTP draft layers (its MTP layout's draft); [] when the family or checkpoint has none
    (MiniMax-M2's config counts MTP modules its release never published: nothing to solve there either)."""

    mtp = mtp_layout(ckpt.config, family_for_config(ckpt.config))
    # a block transformers cannot build is rounded to nearest (SolvedWeights says why)
    if mtp.draft is not None and mtp.draft.unsupported:
        return []
    if mtp.unpublished_line(ckpt.tensors):
        return []
    return [MtpLayerRef(k, names) for k, names in enumerate(draft_layers(ckpt.config, ckpt.tensors))]
