"""verify-manifest: a header-only preflight predicting how SGLang, vLLM and transformers load a Quark checkpoint.

`verify_checkpoint(path, engines=["sglang", "vllm"])` reads config.json, the index and the safetensors headers
(never tensor data), resolves every module the way each engine release does (manifests/engines/) and
returns a `Report` of `Finding`s; `fix_config` writes a corrected config.json elsewhere.
"""

from __future__ import annotations

from pathlib import Path

from quant.checkpoint import Checkpoint, open_checkpoint
from quant.engines import named_releases, select_profiles
from quant.verify import hygiene
from quant.verify.block_fp8 import block_fp8_findings, is_block_fp8
from quant.verify.fix import fix_config
from quant.verify.modules import inventory
from quant.verify.report import Finding, Report, merge_versions
from quant.verify.resolve import ProfileChecker, build_contexts
from quant.verify.schema import (config_problems, model_config_problems, profile_config_problems,
                                 unparsed_model_type)
from quant.verify.shapes import config_shapes, consistency_findings
from quant.verify.sidecars import sidecar_findings
from quant.verify.source import describe_source

__all__ = ["verify_checkpoint", "fix_config", "Report", "Finding"]


def readable_profiles(config: dict, engines: list[str] | None, named: set[str] | None = None
                      ) -> tuple[list, list[Finding]]:
    """The releases `engines` selects, less the default ones that cannot read config.json's model type (each a
    warning saying so: a release named one by one, `--engine sglang==0.5.12`, is checked and fails instead). The
    quantize self-check and verify-manifest both ask this, so by default they check the same releases."""
    profiles = select_profiles(engines)
    named = named_releases(engines) if named is None else named
    unread = [(p, f) for p in profiles if p.label not in named for f in unparsed_model_type(config, p)]
    if not unread or len(unread) == len(profiles):
        return profiles, []
    skipped = {p.label for p, _ in unread}
    notes = [Finding("warning", p.engine, (p.release,), f.tensor,
                     f"not checked by default: {f.message}", f"{f.fix}; --engine {p.label} checks it (and fails)",
                     "default releases") for p, f in unread]
    return [p for p in profiles if p.label not in skipped], notes


def verify_checkpoint(path: str | Path | Checkpoint, engines: list[str] | None = None, tp: int | None = None,
                      metadata_dir: str | Path | None = None, named: set[str] | None = None) -> Report:
    """Predict engine load failures of the Quark (or official block-FP8) checkpoint at `path`. `engines`: names
    ("sglang"), pinned
    releases ("sglang==0.5.12") or "all"; default: the serving engines, SGLang and vLLM. Raises UnreadableCheckpoint
    when it cannot be read.
    `path` may be an open Checkpoint (quant.hub's, read from the Hub's headers). `named`: the releases to check even
    when they cannot read the model type (default: those `engines` names one by one; the self-check: none)."""
    ckpt = path if isinstance(path, Checkpoint) else open_checkpoint(path, metadata_dir)
    profiles, findings = readable_profiles(ckpt.config, engines, named)
    findings += hygiene.integrity_findings(ckpt)
    shape_of = config_shapes(ckpt.config)
    findings += consistency_findings(ckpt, shape_of)
    findings += sidecar_findings(ckpt)
    for profile in profiles:
        findings += model_config_problems(ckpt.config, profile)
    source = describe_source(ckpt)  # an unquantized checkpoint or a microscaled release: described, not failed
    if source is not None:
        is_quark = False
    elif is_block_fp8(ckpt.config):
        findings += block_fp8_findings(ckpt, profiles, shape_of, tp)
        is_quark = False
    else:
        config_findings, is_quark = config_problems(ckpt.config)
        findings += config_findings
    if is_quark:
        modules = inventory(ckpt)
        exclude = ckpt.config["quantization_config"].get("exclude")
        exclude = [str(e) for e in exclude] if isinstance(exclude, list) else []
        unit_cache: dict = {}
        contract_cache: dict = {}
        for profile in profiles:
            findings += profile_config_problems(ckpt.config, profile)
            contexts = build_contexts(profile, ckpt.config, modules, unit_cache)
            findings += ProfileChecker(profile, ckpt.config, modules, tp, contract_cache, shape_of).run(contexts)
            for ctx in contexts:
                findings += hygiene.fused_regex_findings(exclude, profile, [u for u in ctx.units if u.fused])
        findings += hygiene.exclude_findings(exclude, hygiene.lookup_names(modules, ckpt.config), profiles)
        findings += hygiene.mtp_findings(ckpt, profiles)
        findings += hygiene.shared_expert_fusion_findings(ckpt.config, profiles)
    order: dict[str, list[str]] = {}
    for p in profiles:
        order.setdefault(p.engine, []).append(p.release)
    label = str(ckpt.root if isinstance(path, Checkpoint) else path)
    return Report(label, [p.label for p in profiles], merge_versions(findings, order), source)
