"""What a checkpoint that is not a quantized export is: an unquantized one (BF16/F16/F32, no quantization_config) or
a release in a source format `quant quantize` reads (compressed-tensors, ModelOpt, MXFP8, DeepSeek-V4's native
MXFP4/UE8M0), told apart from the headers and config.json alone.

verify-manifest is the Hub workflow's first step, run on the source before quantizing it: such a checkpoint is
described (what an engine loads, what `quant quantize` would write from it), not failed. The engine-independent
checks (integrity, config against tensors, sidecars) still run on it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from quant.checkpoint import Checkpoint
from quant.errors import QuantError
from quant.planning.plan import make_plan, source_format
from quant.planning.recipes import family_for_config, load_recipe
from quant.planning.schemes import DEFAULT_SCHEME, get_scheme
from quant.sources.native import MICROSCALED, is_microscaled, recognise

__all__ = ["SourceDescription", "describe_source"]

CODE_DTYPES = ("U8", "I8", "F8_E4M3", "F8_E5M2", "F8_E8M0")  # what only a quantized weight (or its scale) is stored as


@dataclass(frozen=True)
class SourceDescription:
    """`kind`: "unquantized" or "microscaled"; `what`: one line on what the engines load; `would`: what `quant
    quantize SRC OUT` (default scheme and recipe) would write, or why it cannot."""

    kind: str
    what: str
    would: str

    def to_json(self) -> dict:
        return {"kind": self.kind, "what": self.what, "quantize": self.would}


def describe_source(ckpt: Checkpoint) -> SourceDescription | None:
    """The description of an unquantized or microscaled-release checkpoint; None for anything else (a Quark or
    block-FP8 export, which the engine checks judge, or a checkpoint whose U8/F8 weights no config declares)."""
    config = ckpt.quantization_config
    if not config:
        dtypes = Counter(t.dtype for t in ckpt.tensors.values())
        if any(d in CODE_DTYPES for d in dtypes):
            return None  # packed or FP8 weights without a quantization_config: the engines fail (config_problems)
        listed = ", ".join(f"{d} ({n} tensors)" for d, n in dtypes.most_common())
        return SourceDescription("unquantized", f"an unquantized checkpoint ({listed}, no quantization_config): "
                                 "every engine loads it as it is", _would(ckpt))
    if config.get("quant_method") == "quark" or not is_microscaled(ckpt):
        return None  # a Quark export (its formats are sources too), official block FP8: the engine checks judge it
    kinds = Counter(e.kind for name in ckpt.tensors for e in [_encoding(ckpt, name)] if e is not None)
    if any(kind.startswith("quark-") for kind in kinds):
        return None  # a Quark export's tensors under another config: the engine checks say what fails
    listed = ", ".join(f"{k} ({n} weights)" for k, n in kinds.most_common())
    return SourceDescription("microscaled", f"a release stored microscaled ({listed}; quant_method "
                             f"{config.get('quant_method')!r}): its engines load it with that format's own loader, "
                             "which this preflight does not model (it checks Quark and block-FP8 exports)",
                             _would(ckpt))


def _encoding(ckpt: Checkpoint, name: str):
    try:
        return recognise(ckpt.tensors, name)
    except QuantError:
        return None


def _would(ckpt: Checkpoint) -> str:
    """What `quant quantize` with its defaults would write from `ckpt` (a plan from the headers), or why not."""
    try:
        family = family_for_config(ckpt.config, ckpt.root / "config.json")
        plan = make_plan(ckpt, family, load_recipe(None, family), get_scheme(DEFAULT_SCHEME), "even")
    except QuantError as e:
        return f"quant quantize would refuse it: {e}"
    form = "its microscaled weights decoded exactly once" if source_format(ckpt) == MICROSCALED else "its weights"
    return (f"quant quantize (default scheme {DEFAULT_SCHEME}, recipe {plan.recipe.get('name')}) would quantize "
            f"{len(plan.quantized)} linear(s) from {form} and keep {len(plan.kept_modules)} in BF16 "
            f"(the family {plan.family})")
