"""Toys of families transformers has no class for (Kimi-K3: SGLang and vLLM build it, transformers 5.24 does not):
every tensor written from the toy's `layout` (its entry under `toys` in manifests/families/<family>.yaml), with the
names, shapes and dtypes the release ships, and config.json written as the release writes it (the toy's `config`).

A layout names each tensor under a group: `model` (once), a layer kind (`layer` every decoder layer, or a kind of
`layer_kinds`: `{i}` in the name is the layer index), `expert` (every routed expert of every MoE layer: `{i}` and
`{e}`) and `vision` (shapes over vision_config's keys). A tensor is `[shape...]` (BF16, N(0, initializer_range)) or
`{shape, dtype, init}`: dtype BF16 | F32, init normal | ones | zeros | head_log:<key> (the first <key> entries
log(U(1, 16)), the rest zero: a per-head parameter the release stores padded to another length). Shapes are
arithmetic over the config's integers, nested dicts flattened with "_" (linear_attn_config.head_dim ->
linear_attn_config_head_dim). Layer kinds: `{listed_in: KEY, base: 0|1}` (the layer index, plus base, is in the
list at KEY, dotted for nested dicts; shapes may use `n`, the layer's position in that list, to index a per-layer
list key such as engram_num_embeddings[n]), `{below: KEY}` or `{from: KEY}` (the index against an integer key).
The vision group's shapes also read the text config's keys as text_<key>.

Same name, seed and overrides give byte-identical files (seeded generator, fixed order).
"""

from __future__ import annotations

import copy

from quant.errors import QuantError
from quant.families.shapes import evaluate

__all__ = ["layout_checkpoint"]

DTYPES = ("BF16", "F32")
INITS = ("normal", "ones", "zeros", "head_log:")


def _flat(config: dict, prefix: str = "") -> dict[str, int]:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}_"))
        elif isinstance(value, int) and not isinstance(value, bool):
            out[prefix + key] = value
        elif isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            out[prefix + key] = list(value)  # per-layer sizes (engram_num_embeddings[n])
    return out


def _lookup(config: dict, dotted: str):
    value = config
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise QuantError(f"toy layout: config has no key {dotted!r}")
        value = value[part]
    return value


def _position(layer: int, rules: dict, text: dict) -> dict:
    """{"n": the layer's position in the list of its first `listed_in` kind} (a per-layer size's index)."""
    for rule in rules.values():
        listed = _lookup(text, rule["listed_in"]) if "listed_in" in rule else []
        if layer + int(rule.get("base", 0)) in listed:
            return {"n": listed.index(layer + int(rule.get("base", 0)))}
    return {}


def _kinds_of(layer: int, rules: dict, text: dict) -> list[str]:
    kinds = ["layer"]
    for kind, rule in rules.items():
        if "listed_in" in rule:
            hit = layer + int(rule.get("base", 0)) in _lookup(text, rule["listed_in"])
        elif "below" in rule:
            hit = layer < int(_lookup(text, rule["below"]))
        elif "from" in rule:
            hit = layer >= int(_lookup(text, rule["from"]))
        else:
            raise QuantError(f"toy layout: layer kind {kind!r} has no listed_in / below / from")
        if hit:
            kinds.append(kind)
    return kinds


def _spec(value) -> tuple[list, str, str]:
    if isinstance(value, list):
        return value, "BF16", "normal"
    shape, dtype, init = value["shape"], value.get("dtype", "BF16"), value.get("init", "normal")
    if dtype not in DTYPES or not init.startswith(INITS):
        raise QuantError(f"toy layout: dtype {dtype!r} / init {init!r} (use {DTYPES} / {INITS})")
    return shape, dtype, init


def _tensor(shape: tuple, dtype: str, init: str, std: float, values: dict, generator):
    import torch

    if init == "ones":
        value = torch.ones(shape)
    elif init == "zeros":
        value = torch.zeros(shape)
    elif init.startswith("head_log:"):
        heads = values[init.removeprefix("head_log:")]
        value = torch.zeros(shape)
        value[:heads] = torch.log(torch.empty(heads).uniform_(1.0, 16.0, generator=generator))
    else:
        value = torch.randn(shape, generator=generator) * std
    return value.to(torch.float32 if dtype == "F32" else torch.bfloat16)


def layout_checkpoint(layout: dict, config: dict, text_key: str | None, seed: int) -> tuple[dict, dict]:
    """(tensors, config.json) of a layout toy: `config` is the release's config.json with the toy's sizes (the
    caller has merged overrides and the tokenizer's ids into it)."""
    import torch

    config = copy.deepcopy(config)
    text = config[text_key] if text_key else config
    values = _flat(text)
    # The vision group's shapes read vision_config's keys, and the text config's as text_<key> (an aligner's output).
    vision = {**{f"text_{k}": v for k, v in values.items()}, **_flat(config.get("vision_config") or {})}
    std = float(text.get("initializer_range", 0.02))
    generator = torch.Generator().manual_seed(seed)
    groups = layout.get("groups") or {}
    rules = layout.get("layer_kinds") or {}
    unknown = set(groups) - {"model", "layer", "expert", "vision"} - set(rules)
    if unknown:
        raise QuantError(f"toy layout: groups {sorted(unknown)} are neither fixed groups nor layer_kinds")

    def add(name: str, value, env: dict):
        shape_exprs, dtype, init = _spec(value)
        shape = tuple(evaluate(e, env) for e in shape_exprs)
        if None in shape:
            raise QuantError(f"toy layout: {name}: shape {shape_exprs} does not evaluate on the toy's config")
        tensors[name] = _tensor(shape, dtype, init, std, env, generator)

    tensors: dict = {}
    for name, value in (groups.get("model") or {}).items():
        add(name, value, values)
    experts = int(_lookup(text, layout["experts_key"])) if "experts_key" in layout else 0
    for i in range(int(text["num_hidden_layers"])):
        kinds = _kinds_of(i, rules, text)
        env = {**values, **_position(i, rules, text)}
        for kind in kinds:
            for name, value in (groups.get(kind) or {}).items():
                add(name.format(i=i), value, env)
        if layout.get("expert_kind") in kinds:
            for e in range(experts):
                for name, value in (groups.get("expert") or {}).items():
                    add(name.format(i=i, e=e), value, values)
    for name, value in (groups.get("vision") or {}).items():
        add(name, value, vision)
    return tensors, config
