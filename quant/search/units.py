"""The units of the search: the linears an engine forces to share one format.

All routed experts of a layer (an engine builds them as one FusedMoE), the shards of a fused projection (the
engine profiles' packed_modules_mapping: q/k/v, gate/up), the MTP layer, and the other linears of a layer by role.
A unit starts as (layer, role) and units holding shards of one fused module are merged, for every release asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from quant.checkpoint import Checkpoint, Source
from quant.engines import Profile
from quant.planning.plan import Plan
from quant.planning.treatment import layer_of

ROUTED = "routed_experts"


@dataclass(frozen=True)
class Linear:
    module: str
    shape: tuple[int, int]  # [out, in]
    source: Source
    role: str
    dtype: str  # the source dtype (what a kept module is stored in)


@dataclass(frozen=True)
class Unit:
    name: str
    modules: tuple[str, ...]
    moe: bool  # holds routed experts: the engines' FusedMoE scheme table applies
    mtp: bool  # an MTP layer: the held-out NLL of the main model never runs it


def linears_of(plan: Plan, ckpt: Checkpoint) -> dict[str, Linear]:
    """Every linear a recipe could quantize (plan.linear_params), with where its weight is read from."""
    out: dict[str, Linear] = {}
    for shard in plan.shards:
        for job in shard.jobs:
            module = job.output if job.action == "quantize" else job.output.removesuffix(".weight")
            if module not in plan.linear_params or job.role is None:
                continue
            info = ckpt.tensors[job.source.name]
            if job.source.rows is not None:
                shape = (job.source.rows[1] - job.source.rows[0], int(info.shape[-1]))
            else:
                shape = (int(info.shape[0]), int(info.shape[1]))
            out[module] = Linear(module, shape, job.source, job.role, info.dtype)
    return out


def search_units(linears: Mapping[str, object], roles: dict[str, str], mtp_layers: list[int],
                 profiles: list[Profile]) -> list[Unit]:
    """`linears`: the modules (only their names are read). `roles`: each module's family role (an MTP layer's
    modules included, which the plan may mark mtp_keep)."""
    key_of: dict[str, str] = {}
    for module in linears:
        layer = layer_of(module)
        key_of[module] = f"mtp layer {layer}" if layer in mtp_layers else f"layer {layer} {roles[module]}"
    _merge_fused(key_of, profiles)
    groups: dict[str, list[str]] = {}
    for module, key in key_of.items():
        groups.setdefault(key, []).append(module)
    return [Unit(key, tuple(sorted(mods)), any(roles[m] == ROUTED for m in mods), key.startswith("mtp"))
            for key, mods in sorted(groups.items())]


def _merge_fused(key_of: dict[str, str], profiles: list[Profile]) -> None:
    """Units holding shards of one fused module become one (a fused module takes one scheme in every engine)."""
    for profile in profiles:
        for fused, shards in profile.rules.packed_modules_mapping.items():
            by_fused: dict[str, set[str]] = {}
            for module in key_of:
                prefix, _, leaf = module.rpartition(".")
                if leaf in shards:
                    by_fused.setdefault(f"{prefix}.{fused}", set()).add(key_of[module])
            for keys in by_fused.values():
                target = min(keys)
                for module, key in key_of.items():
                    if key in keys:
                        key_of[module] = target
