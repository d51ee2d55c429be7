"""Which treatments a unit may take: those every asked engine release loads, read from the release's rules as the
preflight reads them (quant.verify: the scheme kind of the layer config the export would write, looked up in the
release's `schemes` table for a Linear or a FusedMoE, its module_failures, and the modules it never quantizes
unless its loader dequantizes the stored format)."""

from __future__ import annotations

import re
from typing import Callable

from quant.checkpoint import FLOAT_DTYPES
from quant.engines import Profile
from quant.pipeline.quark_config import layer_config
from quant.pipeline.run import fused_moe_names
from quant.planning.schemes import Scheme
from quant.planning.written import written_tensors
from quant.search.units import Unit
from quant.verify.schema import classify

SchemeOf = Callable[[str, str], "Scheme | None"]  # (module, treatment) -> the scheme the planner would write


def _stored_family(scheme: Scheme, in_features: int) -> str:
    """What the preflight calls the stored weight (quant.verify.contract.stored_family): packed FP4, FP8, float."""
    dtype = next(d for suffix, d, *_ in written_tensors(scheme, in_features) if suffix == "weight")
    return {"U8": "mxfp4", "F8_E4M3": "fp8"}.get(dtype, "float" if dtype in FLOAT_DTYPES else dtype)


def _loads(profile: Profile, config: dict, module: str, scheme: Scheme, moe: bool, in_features: int,
           scale_mode: str) -> bool:
    names = [module, *profile.renamer(config).names(module)]
    rules = profile.rules
    if any(re.search(p, n) for p in rules.never_quantized for n in names):
        stored = _stored_family(scheme, in_features)
        return any(re.search(p, module) and stored in formats for p, formats in rules.loader_dequantizes.items())
    cfg = layer_config(scheme.name, scale_mode)
    kind = classify(cfg)
    table: dict[str, str] = {str(k): v for k, v in (rules.schemes.moe if moe else rules.schemes.linear).items()}
    verdict = table.get(kind, table.get("other", "refused"))
    if verdict == "ok" and moe and kind == "fp8" and rules.schemes.fp8_moe_qschemes is not None:
        pair = [cfg["weight"].get("qscheme"), (cfg.get("input_tensors") or {}).get("qscheme")]
        verdict = "ok" if pair in rules.schemes.fp8_moe_qschemes else "refused"
    if verdict != "ok":
        return False
    qscheme = cfg["weight"].get("qscheme")
    return not any(f.kind == kind and f.weight_qscheme in (None, qscheme) and re.search(f.module, n)
                   for f in rules.schemes.module_failures for n in names)


# How a release decides a FusedMoE is unquantized, among the engine rules' `moe.excluded_when`: those that an
# export keeping a layer's routed experts in BF16 satisfies. The export names each expert leaf in exclude, never
# the coarse `...mlp.experts` prefix (vLLM 0.31 asserts on a coarse entry), so a release that only looks the
# FusedMoE up by its coarse prefix (SGLang) builds those experts quantized and fails on the BF16 tensors.
KEPT_MOE_LOADS_WHEN = ("coarse_or_any_leaf", "per_leaf")


def unit_menu(unit: Unit, treatments: tuple[str, ...], scheme_of: SchemeOf, in_features: dict[str, int],
              profiles: list[Profile], config: dict, scale_mode: str) -> list[str]:
    """The treatments of `treatments` that every release in `profiles` loads for every module of `unit`."""
    menu = []
    for treatment in treatments:
        ok = True
        for module in unit.modules:
            scheme = scheme_of(module, treatment)
            if scheme is None:  # kept BF16 (by this treatment, or by the family under it)
                if fused_moe_names([module]) and not all(  # a routed expert's linear, main or MTP layer
                        p.rules.moe.excluded_when in KEPT_MOE_LOADS_WHEN for p in profiles):
                    ok = False
                    break
                continue
            if in_features[module] % scheme.k_multiple:
                ok = False  # the planner refuses it (blocks run along the input dim)
            moe = unit.moe and ".experts." in module
            ok = ok and all(_loads(p, config, module, scheme, moe, in_features[module], scale_mode)
                            for p in profiles)
            if not ok:
                break
        if ok:
            menu.append(treatment)
    return menu
