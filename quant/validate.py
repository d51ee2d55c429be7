"""One validation of a checkpoint's config.json (its Quark config too) against itself and its tensors, run by
quantize, verify-manifest and eval before any work.

Two kinds of problem, two exit codes (README):
- the checkpoint is not valid (UnreadableCheckpoint, exit 2): a config.json value the tool computes with of the
  wrong type or range, a missing or non-string `model_type`, a malformed Quark config, a count that more layers
  than the tensor names hold. `validate_config` (in quant/checkpoint.py, re-exported here) raises the first when
  a checkpoint is opened (`quant.checkpoint.open_checkpoint`), so every later stage works on values of the right
  type.
- an engine would fail or load wrong weights (exit 1): the config and the tensors disagree. `model_type` is not
  one transformers' AutoConfig knows (engines build their config through it), a layer the config declares has
  no tensor, a weight the config sizes is not a non-empty 2-D tensor, a routed expert is missing or shaped
  unlike the config. `consistency_findings` lists them (verify-manifest reports them among its findings);
  `require_valid` raises the first (quantize and eval, before anything is written or generated).

Every check costs time bounded by the number of tensors, never by a number in the config: counts are compared
with what the tensor names show, and the examples named in a message are found by scanning at most a few more
indices than there are tensors. Vision-language wrappers (Qwen3.5: text_config, model.language_model.*,
model.visual.*, mtp.*) are checked through their text config and language-model names.
"""

from __future__ import annotations

# Where each half lives: validate_config (not a valid checkpoint) runs inside open_checkpoint, so it sits in
# quant/checkpoint.py; the config/tensor consistency checks are preflight findings and sit with the shape rules
# in quant/verify/shapes.py. This module is the one place quantize and eval call.
from quant.checkpoint import lm_layer_indices, validate_config
from quant.errors import EngineFailure, QuantError, UnreadableCheckpoint
from quant.verify.scales import ScanStats, scan_issues
from quant.verify.shapes import consistency_findings, known_model_types
from quant.verify.sidecars import source_draft_problems

__all__ = ["validate_config", "lm_layer_indices", "known_model_types", "consistency_findings", "require_valid",
           "require_sound_scales", "require_loadable_drafts"]


def require_valid(ckpt) -> None:
    """Raise a one-line error for a checkpoint quantize or eval cannot work on: an integrity problem of its
    index and shards (`Checkpoint.problems`), else the first consistency finding (how many more, too)."""
    ckpt.require_intact()
    errors = [f for f in consistency_findings(ckpt) if f.severity == "error"]
    if errors:
        more = f" (and {len(errors) - 1} more like it; `quant verify-manifest` lists them)" if len(errors) > 1 else ""
        raise EngineFailure(f"{ckpt.root}: {errors[0].message}{more}")


def require_sound_scales(ckpt, log=print) -> ScanStats:
    """Read every scale tensor of the source (`quant.verify.scales`: never a weight; a Hub source by range
    requests) and refuse the first weight scale the run would refuse halfway or turn into a broken export:
    an E8M0 0xFF (NaN) byte, a whole weight of E8M0 0x00, a NaN, inf, negative or all-zero float or E4M3
    scale (NVFP4's global scale included), and a scale tensor that cannot be read. UnreadableCheckpoint (exit 2)
    names the shard and the tensor; quantize calls it before OUT holds anything. A bad activation scale (consumed
    with its weight, never written) is reported in one line and does not stop the run. Returns what was read."""
    stats = ScanStats()
    unreadable, issues = scan_issues(ckpt, stats=stats)
    if unreadable:
        raise UnreadableCheckpoint(f"{unreadable[0].message}; nothing was written")
    errors = [i for i in issues if i.severity == "error"]
    weight_errors = [i for i in errors if not i.activation]
    if weight_errors:
        first = weight_errors[0]
        more = f" (and {len(weight_errors) - 1} more)" if len(weight_errors) > 1 else ""
        raise UnreadableCheckpoint(f"{ckpt.shard_path(ckpt.tensors[first.tensor].file)}: {first.line()}{more}; "
                                   f"nothing was written")
    for issue in errors[:1]:
        log(f"note: {issue.line()} (an activation scale of the source: consumed, not written; "
            f"{len(errors)} such)")
    return stats


def require_loadable_drafts(ckpt) -> None:
    """Refuse (exit 2, before OUT exists) a source whose declared draft file holds what the engine's draft class
    cannot load (quant.verify.sidecars): the export would carry it byte for byte. Headers only."""
    problems = source_draft_problems(ckpt)
    if problems:
        raise QuantError(f"{ckpt.root}: {problems[0].message} (fix: {problems[0].fix}); nothing was written")
