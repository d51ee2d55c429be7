"""Preflight for official block-FP8 checkpoints (`quant_method: "fp8"`, `weight_block_size: [128, 128]`, the
DeepSeek-V3/GLM format; what `--scheme fp8-block` writes for the FP8 baseline).

Contract (moe-layouts.md §4, mx-numerics.md §10): every quantized linear stores `weight` F8_E4M3 [out, in] and
`weight_scale_inv` F32 [ceil(out/128), ceil(in/128)]; a linear stored in BF16 must be named in
`modules_to_not_convert`, unless the engine builds that module without asking the quant config at all
(routers, indexer weights_proj, embeddings, heads, the MTP eh_proj, which is a plain nn.Linear outside Quark).
"""

from __future__ import annotations

import math
import re

from quant.checkpoint import FLOAT_DTYPES, Checkpoint, text_config
from quant.engines import Profile
from quant.verify.report import Finding
from quant.verify.shapes import ShapeOf

RULE = "block-FP8 contract"
QCFG = "config.json:quantization_config"
PLAIN_LINEAR_IN_FP8_MODELS = re.compile(r"\.eh_proj$")


def is_block_fp8(config: dict) -> bool:
    q = config.get("quantization_config")
    return isinstance(q, dict) and q.get("quant_method") == "fp8" and q.get("weight_block_size") is not None


def _all(tensor: str, message: str, fix: str) -> Finding:
    return Finding("error", "all", (), tensor, message, fix, RULE)


def moe_block_findings(ckpt: Checkpoint, profiles: list[Profile], tp: int | None) -> list[Finding]:
    """Engines whose FP8 FusedMoE cannot take 128x128 block scales for this moe_intermediate_size (per TP
    partition): the `block_fp8_moe` rule of each profile (manifests/engines.yaml)."""
    cfg = text_config(ckpt.config)
    inter, hidden = cfg.get("moe_intermediate_size"), cfg.get("hidden_size")
    experts = sorted(n for n, t in ckpt.tensors.items()
                     if ".experts." in n and n.endswith(".weight") and t.dtype == "F8_E4M3")
    if not experts or not isinstance(inter, int) or not isinstance(hidden, int) or inter <= 0 or hidden <= 0:
        return []
    tp = tp or 1
    per_partition = inter // tp
    aligned = inter % tp == 0 and per_partition % 128 == 0
    out = []
    for profile in profiles:
        rule = profile.rules.get("block_fp8_moe")
        if rule is None or aligned:
            continue
        refine = math.gcd(128, per_partition, hidden)
        if rule == "refine" and refine >= 32:
            message = (f"{profile.title} refines the FP8 MoE blocks to {refine}x{refine} for moe_intermediate_size "
                       f"{inter}{f'/TP {tp}' if tp > 1 else ''} and upsamples the checkpoint's 128x128 scales by "
                       f"{128 // refine}: the grids differ (e.g. {math.ceil(per_partition / 128) * (128 // refine)} "
                       f"vs {math.ceil(per_partition / refine)} rows), so loading {experts[0]}_scale_inv fails with "
                       "\"The size of tensor a (...) must match the size of tensor b (...)\" in _load_w2/_load_w13")
        else:
            message = (f"{profile.title} raises ValueError(\"The output_size of gate's and up's weight = "
                       f"{per_partition} is not divisible by weight quantization block_n = 128.\") while building "
                       "the block-FP8 FusedMoE")
        out.append(Finding("error", profile.engine, (profile.release,), experts[0], message,
                           "keep the routed experts in BF16 (modules_to_not_convert) or export them with another "
                           "scheme (Quark FP8 per-channel, MXFP4); moe_intermediate_size per TP rank must be a "
                           "multiple of 128 for block FP8", RULE + " (MoE blocks)"))
    return out


def merged_gemm_findings(ckpt: Checkpoint, profiles: list[Profile]) -> list[Finding]:
    """Engines that build fused modules (qkv_proj, gate_up_proj, ...) as one block-FP8 GEMM need every shard but
    the last to end on a 128-row block (`block_fp8_merged` in manifests/engines.yaml)."""
    out = []
    tensors = ckpt.tensors
    for profile in profiles:
        if profile.rules.get("block_fp8_merged") != "last_shard_only":
            continue
        for fused, shards in (profile.rules.get("packed_modules_mapping") or {}).items():
            for name, info in tensors.items():
                if not name.endswith(f".{shards[0]}.weight") or info.dtype != "F8_E4M3":
                    continue
                parent = name[: -len(f".{shards[0]}.weight")]
                present = [(s, tensors.get(f"{parent}.{s}.weight")) for s in shards]
                present = [(s, t) for s, t in present if t is not None and t.dtype == "F8_E4M3"]
                if len(present) < 2:
                    continue
                bad = [(s, t.shape[0]) for s, t in present[:-1] if t.shape[0] % 128]
                if bad:
                    shard, rows = bad[0]
                    out.append(Finding(
                        "error", profile.engine, (profile.release,), f"{parent}.{shard}.weight_scale_inv",
                        f"{profile.title} builds {parent}.{fused} as one block-FP8 GEMM from "
                        f"{', '.join(s for s, _ in present)}; {parent}.{shard} has {rows} output rows, not a "
                        "multiple of 128, and only the last shard may end in a partial block, so its 128-row scale "
                        "blocks cannot be placed (ValueError \"Weight output_partition_size = "
                        f"{rows} is not divisible by weight quantization block_n = 128.\", or a RuntimeError "
                        "while loading the scales)",
                        f"keep {parent}.{shard} and its fused siblings in BF16 (modules_to_not_convert), or use "
                        "a scheme without 128-row blocks", RULE + " (merged GEMM)"))
    return out


def block_fp8_findings(ckpt: Checkpoint, profiles: list[Profile], shape_of: ShapeOf | None = None,
                       tp: int | None = None) -> list[Finding]:
    q = ckpt.config["quantization_config"]
    out: list[Finding] = []
    if list(q.get("weight_block_size") or []) != [128, 128]:
        out.append(_all(f"{QCFG}.weight_block_size", f"weight_block_size {q.get('weight_block_size')} is not "
                        "[128, 128], the only block size the DeepSeek/GLM FP8 kernels take", "requantize 128x128"))
    if q.get("activation_scheme", "dynamic") != "dynamic":
        out.append(_all(f"{QCFG}.activation_scheme", f"activation_scheme {q.get('activation_scheme')!r} needs "
                        "static input scales that block-FP8 checkpoints do not carry", "use 'dynamic'"))
    skip = q.get("modules_to_not_convert") or []
    if not isinstance(skip, list):
        out.append(_all(f"{QCFG}.modules_to_not_convert", "modules_to_not_convert must be a list", "write a list"))
        skip = []
    tensors = ckpt.tensors
    for name, info in sorted(tensors.items()):
        if name.endswith(".weight_scale_inv"):
            weight = tensors.get(name[: -len("_scale_inv")])
            if weight is None or weight.dtype != "F8_E4M3":
                out.append(_all(name, f"{name} has no F8_E4M3 weight next to it; the loader finds no parameter "
                                "for it", "drop the scale or store the weight in FP8"))
            continue
        if not name.endswith(".weight") or len(info.shape) != 2:
            continue
        module = name[: -len(".weight")]
        expected = shape_of(module) if shape_of else None
        if expected and tuple(info.shape) != tuple(expected):
            out.append(_all(name, f"{name} is {info.dtype} {list(info.shape)}, but the engines allocate "
                            f"{list(expected)} for it from config.json", "re-export it with the config's shape"))
            continue
        if info.dtype == "F8_E4M3":
            scale = tensors.get(module + ".weight_scale_inv")
            want = (-(-info.shape[0] // 128), -(-info.shape[1] // 128))
            if scale is None or scale.dtype != "F32" or tuple(scale.shape) != want:
                got = f"{scale.dtype} {list(scale.shape)}" if scale else "missing"
                out.append(_all(module + ".weight_scale_inv", f"{module} is F8_E4M3 {list(info.shape)} and needs "
                                f"weight_scale_inv F32 {list(want)}, found {got}", "write the 128x128 block scales"))
            continue
        if info.dtype not in FLOAT_DTYPES or module in skip or PLAIN_LINEAR_IN_FP8_MODELS.search(module):
            continue
        for profile in profiles:
            never = [re.compile(p) for p in profile.rules.get("never_quantized", [])]
            if any(p.search(module) for p in never):
                continue
            out.append(Finding("error", profile.engine, (profile.release,), name,
                               f"{profile.engine} builds {module} as block FP8 and expects F8_E4M3 "
                               f"{list(info.shape)} with weight_scale_inv, but {name} is {info.dtype}",
                               f"add {module} to modules_to_not_convert", RULE))
    return out + moe_block_findings(ckpt, profiles, tp) + merged_gemm_findings(ckpt, profiles)
