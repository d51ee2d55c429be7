"""The MTP (multi-token-prediction) draft head of a checkpoint, run in process the way SGLang and vLLM run it for
speculative decoding: what the acceptance measurement drafts with (evals/arms/mtp_measure.py, evals/arms/backends.py).

It is built and run by quant.model_exec.mtp (see there for the forward and where the family data places its
tensors), the same code GPTQ calibrates the MTP layer with; this module hands its names on to the eval stage.
"""

from quant.model_exec.mtp import DraftLayer, DraftNames, MtpDraft, block_tensors, draft_layers, load_draft

__all__ = ["DraftLayer", "DraftNames", "MtpDraft", "block_tensors", "draft_layers", "load_draft"]
