"""Checkpoint modules and the units an engine builds from them.

A checkpoint *module* is a tensor-name prefix with its parameters (`X.weight`, `X.weight_scale`, ...). A *unit*
is what one engine instantiates and looks up in the quant config: a plain linear, a fused linear
(`gate_up_proj` built from the `gate_proj` and `up_proj` shards) or a FusedMoE (`...mlp.experts`, built from
every per-expert leaf). Units carry the engine's runtime names (MTP layers renamed per engine).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from quant.checkpoint import Checkpoint, TensorInfo
from quant.errors import QuantError
from quant.families import family_for_config
from quant.families.sidecars import sidecar_pattern
from quant.families.shapes import LM_LAYER  # model.layers.N. and the VL wrappers' language-model layers



@dataclass
class Module:
    name: str
    params: dict[str, TensorInfo] = field(default_factory=dict)  # suffix ("weight", "weight_scale") -> info
    layer: int | None = None  # index of model.layers.{i}.*, None outside the decoder stack

    @property
    def weight(self) -> TensorInfo | None:
        return self.params.get("weight")

    @property
    def is_linear(self) -> bool:
        w = self.weight
        return w is not None and len(w.shape) == 2


def decoder_tensors(ckpt: Checkpoint) -> dict:
    """The checkpoint's tensors but its sidecars' (Engram tables): no engine builds those from the quantization
    config (vLLM's ParallelEngramEmbedding has none), so they are no module here; quant/verify/sidecars.py checks
    them."""
    try:
        sidecar = sidecar_pattern(family_for_config(ckpt.config).sidecars)
    except QuantError:
        sidecar = None
    return {n: t for n, t in ckpt.tensors.items() if sidecar is None or not sidecar.match(n)}


def inventory(ckpt: Checkpoint) -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for name, info in decoder_tensors(ckpt).items():
        prefix, _, suffix = name.rpartition(".")
        if not prefix:
            continue
        mod = modules.get(prefix)
        if mod is None:
            m = LM_LAYER.match(prefix)
            mod = modules[prefix] = Module(prefix, layer=int(m.group(1)) if m else None)
        mod.params[suffix] = info
    return modules


def expert_coarse(name: str) -> str | None:
    """`a.mlp.experts` for a per-expert leaf `a.mlp.experts.7.down_proj` (the FusedMoE prefix), else None."""
    if ".experts." not in name:
        return None
    head, index, _proj = name.rsplit(".", 2) if name.count(".") >= 2 else (name, "", "")
    return head if index.isdigit() and head.endswith(".experts") else None


@dataclass
class Unit:
    """One module an engine builds. `members` are checkpoint module names (fused shards in mapping order, or
    expert leaves); `shard_runtime` are the runtime names the engine checks the exclude list with."""

    runtime: str
    kind: str  # "linear" | "moe"
    members: list[str]
    shard_runtime: list[str]
    fused: str | None = None
    mtp: bool = False
    missing_shards: list[str] = field(default_factory=list)


def build_units(modules: dict[str, Module], runtime_name: Callable[[str], str | list[str] | None],
                packed: dict[str, list[str]], group_experts: bool,
                is_mtp: Callable[[str], bool]) -> list[Unit]:
    """Units for every linear module; `runtime_name` maps a checkpoint module to the engine's name (None:
    the engine does not build it; a list: the engine builds it as several modules, one unit each)."""
    shard_to_fused = {shard: fused for fused, shards in packed.items() for shard in shards}
    units: list[Unit] = []
    moe: dict[str, Unit] = {}
    fused_groups: dict[tuple[str, str], dict[str, tuple[str, str]]] = {}
    for name, mod in modules.items():
        if not mod.is_linear:
            continue
        runtime = runtime_name(name)
        if runtime is None:
            continue
        if isinstance(runtime, list):
            units.extend(Unit(part, "linear", [name], [part], mtp=is_mtp(name)) for part in runtime)
            continue
        coarse = expert_coarse(runtime) if group_experts else None
        if coarse:
            unit = moe.get(coarse)
            if unit is None:
                unit = moe[coarse] = Unit(coarse, "moe", [], [], mtp=is_mtp(name))
            unit.members.append(name)
            unit.shard_runtime.append(runtime)
            continue
        parent, _, proj = runtime.rpartition(".")
        if proj in shard_to_fused:
            fused_groups.setdefault((parent, shard_to_fused[proj]), {})[proj] = (name, runtime)
            continue
        units.append(Unit(runtime, "linear", [name], [runtime], mtp=is_mtp(name)))
    for (parent, fused), present in fused_groups.items():
        shards = packed[fused]
        if len(present) == 1:  # a lone q_proj (MLA without q_lora) is not a fused module
            (name, runtime), = present.values()
            units.append(Unit(runtime, "linear", [name], [runtime], mtp=is_mtp(name)))
            continue
        order = [s for s in shards if s in present]
        units.append(Unit(f"{parent}.{fused}", "linear", [present[s][0] for s in order],
                          [present[s][1] for s in order], fused=fused, mtp=is_mtp(present[order[0]][0]),
                          missing_shards=[f"{parent}.{s}" for s in shards if s not in present]))
    units.extend(moe.values())
    return units
