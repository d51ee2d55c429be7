"""The search, end to end: units and their menus from the engine profiles, each choice priced and measured, the
exact pick within the budget, and the recipe that writes it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from quant.checkpoint import DTYPE_BYTES, open_checkpoint
from quant.errors import QuantError
from quant.families import family_for_config, mtp_layout, text_config
from quant.gptq.calibration import CalibrationSettings, calibration_tokens
from quant.planning.plan import make_plan
from quant.planning.recipes import TREATMENTS, Recipe, load_recipe
from quant.planning.schemes import DEFAULT_SCHEME, Scheme, get_scheme
from quant.planning.treatment import ModuleTreatment
from quant.search.fisher import fisher_losses
from quant.search.menu import unit_menu
from quant.search.sensitivity import check_views, load_model, mean_kl, mean_nll, quantized, reference_logprobs
from quant.search.sizes import header_bytes, stored_bytes
from quant.search.loadable import loadable_pick
from quant.search.recipe_file import recipe_yaml, reference
from quant.search.searched import Choice, Searched
from quant.search.solver import Option, pareto_front
from quant.search.units import Linear, Unit, linears_of, search_units
from quant.verify import readable_profiles, unparsed_model_type

REFERENCE_RECIPES = ("all-linear", "experts-mxfp4-rest-mxfp8", "experts-only")
SHARD_OVERHEAD = 8 + 256  # a shard's length prefix, its __metadata__ and padding (an upper bound)


def _treatment_rule(family, primary: Scheme, mtp) -> Callable[[str, str], Scheme | None]:
    """(module, treatment) -> the scheme the planner writes: the planner's own rule (ModuleTreatment), asked with a
    recipe that gives every module `treatment`."""
    rules = {t: ModuleTreatment(family, Recipe(t, "", {}, modules=[(re.compile(""), t)]), primary, mtp)
             for t in TREATMENTS}
    return lambda module, treatment: rules[treatment](module)[1]


SENSITIVITIES = ("kl", "fisher")


def measure(src: Path, engines: list[str] | None, calib: CalibrationSettings, scale_mode: str = "even",
            log: Callable[[str], None] = print, sensitivity: str = "fisher", state_dir: Path | None = None) -> Searched:
    """Units, their menus and prices, and each choice's loss: `kl` measures it exactly on the whole model in
    memory (sensitivity.py), `fisher` estimates it streaming one decoder layer at a time (fisher.py)."""
    if sensitivity not in SENSITIVITIES:
        raise QuantError(f"--sensitivity {sensitivity}: one of {', '.join(SENSITIVITIES)}")
    ckpt = open_checkpoint(src)
    family = family_for_config(ckpt.config)
    primary = get_scheme(DEFAULT_SCHEME)
    plan = make_plan(ckpt, family, load_recipe("all-linear", family), primary, scale_mode)
    if plan.source_format != "bf16":
        raise QuantError(f"{src}: quant search reads a BF16 source (this one is {plan.source_format})")
    config = text_config(ckpt.config)
    mtp = mtp_layout(config, family)
    scheme_of = _treatment_rule(family, primary, mtp)
    linears = linears_of(plan, ckpt)
    profiles, _ = readable_profiles(ckpt.config, engines)  # by default, the releases verify-manifest checks
    for profile in profiles:
        for unreadable in unparsed_model_type(ckpt.config, profile):
            raise QuantError(f"--engine {profile.label}: {unreadable.message}; nothing it loads can be searched "
                             f"({unreadable.fix})")
    roles = {m: family.role_of(m) or "" for m in linears}
    units = search_units(linears, roles, list(mtp.decoder_layers), profiles)
    in_features = {m: lin.shape[1] for m, lin in linears.items()}
    menus, prices, pinned, mtp_menus = {}, {}, {}, {}
    for unit in units:
        menu = unit_menu(unit, TREATMENTS, scheme_of, in_features, profiles, ckpt.config, scale_mode)
        if not menu:
            raise QuantError(f"{unit.name}: no treatment loads in every release asked ({', '.join(engines or [])})")
        prices[unit.name] = {t: _price(unit, linears, scheme_of, t) for t in menu}
        if unit.mtp:  # the NLL never runs the draft: its smallest loadable format (BENCHMARKS.md "MTP recipe")
            menu = sorted(menu, key=lambda t: prices[unit.name][t][1])
            mtp_menus[unit.name] = Choice(unit, [Option(t, prices[unit.name][t][1], 0.0) for t in menu],
                                          {t: prices[unit.name][t][0] for t in menu})
            menu = menu[:1]
            pinned[unit.name] = menu[0]
        menus[unit.name] = menu
    windows = calibration_tokens(calib, src)
    if sensitivity == "fisher":
        base = None  # the streamed pass never holds the whole model's NLL
        log(f"search: {len(units)} units, Fisher estimate over {windows.shape[0]} windows, one layer at a time")
        losses = fisher_losses(src, ckpt, family.layer_returns, units, menus, linears, scheme_of, windows,
                               scale_mode, log=log, state_dir=state_dir)
    else:
        base, losses = _kl_losses(src, ckpt, units, menus, linears, scheme_of, windows, scale_mode, log)
    choices = []
    for unit in units:
        options = [Option(t, prices[unit.name][t][1], losses.get(unit.name, {}).get(t, 0.0))
                   for t in menus[unit.name]]
        choices.append(Choice(unit, options, {t: prices[unit.name][t][0] for t in menus[unit.name]}))
    fixed = SHARD_OVERHEAD * len(ckpt.files)
    sources = {lin.source.name for lin in linears.values()}
    for name, info in ckpt.tensors.items():
        if name not in sources:
            fixed += info.numel * DTYPE_BYTES.get(info.dtype, 1) + header_bytes(name, info.dtype, tuple(info.shape))
    return Searched(fixed, choices, sum(plan.linear_params.values()), base, pinned, mtp_menus)


def _kl_losses(src: Path, ckpt, units: list[Unit], menus: dict[str, list[str]], linears: dict[str, Linear],
               scheme_of, windows, scale_mode: str, log) -> tuple[float | None, dict[str, dict[str, float]]]:
    """The exact measure: the whole model in memory, each choice's KL from the BF16 model's predictions."""
    model = load_model(src)
    measured = [linears[m] for u in units if not u.mtp for m in u.modules]
    check_views(model, measured, lambda lin: read_weight(ckpt, lin))
    reference_lp = reference_logprobs(model, windows)
    base = mean_nll(windows, reference_lp)
    log(f"search: {len(units)} units, BF16 calibration NLL {base:.4f} over {windows.shape[0]} windows")
    losses: dict[str, dict[str, float]] = {}
    for unit in units:
        if unit.mtp:
            continue
        for t in menus[unit.name]:
            chosen = [(linears[m], s) for m in unit.modules if (s := scheme_of(m, t)) is not None]
            loss = 0.0
            if chosen:
                with quantized(model, chosen, scale_mode):
                    loss = mean_kl(model, windows, reference_lp)
            losses.setdefault(unit.name, {})[t] = loss
            log(f"  {unit.name}: {t} KL {loss:.6f}")
    return base, losses


def read_weight(ckpt, linear: Linear):
    """`linear`'s weight as the checkpoint stores it (its expert and rows of a fused tensor)."""
    from safetensors import safe_open

    with safe_open(str(ckpt.root / linear.source.file), "pt") as f:
        tensor = f.get_tensor(linear.source.name)
    if linear.source.expert is not None:
        tensor = tensor[linear.source.expert]
    if linear.source.rows is not None:
        tensor = tensor[linear.source.rows[0]:linear.source.rows[1]]
    return tensor


def _price(unit: Unit, linears: dict[str, Linear], scheme_of, treatment: str) -> tuple[int, int]:
    data = total = 0
    for m in unit.modules:
        lin = linears[m]
        d, t = stored_bytes(m, lin.shape, lin.dtype, scheme_of(m, treatment))
        data, total = data + d, total + t
    return data, total


def search(src: Path, engines: list[str] | None, calib: CalibrationSettings, max_size: int | None = None,
           bits: float | None = None, scale_mode: str = "even", log: Callable[[str], None] = print,
           sensitivity: str = "fisher", state_dir: Path | None = None) -> dict:
    """Measure, pick within the budget, and describe: the recipe text, the pick's totals, the Pareto front with
    the uniform recipes beside it."""
    searched = measure(src, engines, calib, scale_mode, log, sensitivity, state_dir)
    ckpt = open_checkpoint(src)  # headers and config, read once for every preview and the reference recipes
    chosen = loadable_pick(ckpt, searched, engines, max_size, bits, scale_mode, log)
    if chosen is None:
        smallest = searched.size(pareto_front([c.options for c in searched.choices])[0].choices)
        budget = f"--max-size {max_size}" if bits is None else f"--bits {bits}"
        raise QuantError(f"no mix of the engines' formats fits {budget}; the smallest is {smallest} bytes")
    family = family_for_config(ckpt.config)

    def row(picks: tuple[int, ...], what: str) -> dict:
        return {"size_bytes": searched.size(picks), "effective_bits": searched.effective_bits(picks),
                "predicted_loss": round(sum(c.options[i].loss for c, i in zip(searched.choices, picks)), 6),
                "what": what}

    front = [row(p.choices, "pareto") for p in pareto_front([c.options for c in searched.choices])]
    for name in REFERENCE_RECIPES:
        ref = reference(searched, name, family)
        if ref is not None:
            front.append(row(ref, f"recipe {name}"))
    front.sort(key=lambda r: (r["size_bytes"], r["predicted_loss"]))
    totals = row(chosen, "pick")
    note = (f"quant search: {totals['size_bytes']} bytes, {totals['effective_bits']} effective bits, predicted NLL "
            f"rise {totals['predicted_loss']:+.5f} nats")
    return {"recipe": {c.unit.name: c.options[i].label for c, i in zip(searched.choices, chosen)},
            "recipe_yaml": recipe_yaml(searched, chosen, note), "size_bytes": totals["size_bytes"],
            "effective_bits": totals["effective_bits"], "predicted_loss": totals["predicted_loss"],
            "bf16_calibration_nll": None if searched.bf16_nll is None else round(searched.bf16_nll, 6),
            "sensitivity": sensitivity, "front": front}
