"""A toy's `release_extras` (manifests/toys.yaml documents the keys): what a release adds on top of the transformers
model its toy is built from, when transformers has no class for the release itself (DeepSeek-V4.1 is DeepSeek-V4's
decoder plus Engram tables, DSpark draft heads and a vision tower, under a nested config).

Applied after transformers' save and the release's config fixes, before the release's storage (`native`):
  drop     regexes of tensors transformers writes that the release lacks (V4.1 has no learned hc_head)
  nest     {key: text_config, keep: [top-level keys]}: every other config.json key moves under `key`
           (model_type dropped there), as the release nests it
  layout   tensors the transformers model lacks, in quant/toy/layout.py's group syntax over the nested config;
           a name's `{last}` is the last MTP stage (DSpark heads live on mtp.{last})
  fp8_rows regexes of tables stored as float8_e4m3fn with one E8M0 `.scale` per 32 entries of a row (the Engram
           tables' storage, vLLM's ParallelEngramEmbedding block_size 32)
  file     a safetensors file the release ships beside its shards (MiniMax-M3.1's DSpark draft): {name, config:
           the config.json keys declaring it (merged in, as release_config is), layout: its tensors in
           quant/toy/layout.py's syntax over the text config's keys read over the top level's}; written as stored
           (no release storage format applies) and listed in the index
"""

from __future__ import annotations

import copy
import re

from quant.errors import QuantError
from quant.families import text_config
from quant.sources.mxfp8 import encode_mxfp8_release

__all__ = ["RELEASE_EXTRAS_KEYS", "FILE_KEYS", "release_extras", "release_file", "encode_rows", "merge_into"]

RELEASE_EXTRAS_KEYS = ("drop", "nest", "layout", "fp8_rows", "file")
FILE_KEYS = ("name", "config", "layout")


def merge_into(base: dict, extra: dict) -> dict:
    """Merge `extra` into `base`; a None in `extra` removes the key (a transformers spelling the release lacks)."""
    for key, value in extra.items():
        if value is None:
            base.pop(key, None)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            merge_into(base[key], value)
        else:
            base[key] = value
    return base


def _nest(config_json: dict, nest: dict) -> dict:
    key, keep = nest["key"], set(nest.get("keep") or [])
    inner = {k: v for k, v in config_json.items() if k not in keep and k != "model_type"}
    out = {k: v for k, v in config_json.items() if k in keep or k == "model_type"}
    out[key] = inner
    return out


def _layout_with_last(layout: dict, last: int) -> dict:
    layout = copy.deepcopy(layout)
    for group in (layout.get("groups") or {}).values():
        for name in [n for n in group if "{last}" in n]:
            group[name.replace("{last}", str(last))] = group.pop(name)
    return layout


def release_extras(spec: dict, tensors: dict, config_json: dict, n_mtp: int, seed: int) -> tuple[dict, dict]:
    """(tensors, config.json) of the release: `spec` is the toy's `release_extras`."""
    from quant.toy.layout import layout_checkpoint

    drop = [re.compile(p) for p in spec.get("drop") or []]
    tensors = {k: v for k, v in tensors.items() if not any(p.search(k) for p in drop)}
    nest = spec.get("nest")
    if nest:
        config_json = _nest(config_json, nest)
    if spec.get("layout"):
        if n_mtp < 1 and any("{last}" in n for g in spec["layout"].get("groups", {}).values() for n in g):
            raise QuantError("toy release_extras: the layout names mtp.{last} heads but the toy has no MTP stage")
        layout = _layout_with_last(spec["layout"], n_mtp - 1)
        extra, _ = layout_checkpoint(layout, config_json, nest["key"] if nest else None, seed + 2)
        clash = sorted(set(extra) & set(tensors))
        if clash:
            raise QuantError(f"toy release_extras: the layout names tensors transformers already wrote: {clash[:3]}")
        tensors = {**tensors, **extra}
    return tensors, config_json


def release_file(spec: dict, config_json: dict, seed: int) -> tuple[tuple[str, dict] | None, dict]:
    """((file name, tensors) or None, config.json) of the toy's `release_extras.file`: the keys declaring it merged
    into config.json, its tensors laid out over the text config read over the top level (quant.families.
    text_config: a wrapper release may declare it at the top, as MiniMax-M3.1 does its dspark_* keys)."""
    from quant.toy.layout import layout_checkpoint

    file = spec.get("file")
    if not file:
        return None, config_json
    config_json = merge_into(copy.deepcopy(config_json), copy.deepcopy(file.get("config") or {}))
    tensors, _ = layout_checkpoint(file["layout"], text_config(config_json), None, seed + 3)
    return (file["name"], tensors), config_json


def encode_rows(tensors: dict, patterns) -> dict:
    """Tables matching `patterns` (`X.weight`) as float8_e4m3fn + float8_e8m0fnu `X.scale` [rows, cols / 32]."""

    compiled = [re.compile(p) for p in patterns or []]
    out = {}
    for name, value in tensors.items():
        if name.endswith(".weight") and any(p.search(name) for p in compiled):
            import torch

            q, scale = encode_mxfp8_release(value)
            out[name], out[name[: -len("weight")] + "scale"] = q, scale.view(torch.uint8).view(torch.float8_e8m0fnu)
        else:
            out[name] = value
    return out
