"""`verify-manifest --fix`: a corrected config.json written next to (never over) the checkpoint's.

What config alone can repair: missing schema keys (export, kv_cache_group, exclude, layer configs and their
four tensor keys), exclude entries for every module stored unquantized under every name an engine looks up
(`exclude_aliases`: MTP runtime names, the coarse draft FusedMoE prefix), `re:` twins of fnmatch globs, exact
entries naming modules that are stored quantized, and SGLang runtime-name twins of MTP layer_quant_config keys.
Tensor layouts (a wrong shape, a half-excluded fused module) need a re-export.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

from quant import engines
from quant.checkpoint import Checkpoint, open_checkpoint
from quant.errors import QuantError
from quant.files import write_atomic
from quant.verify.contract import stored_family
from quant.verify.hygiene import glob_to_regex
from quant.verify.matching import is_glob
from quant.verify.modules import inventory

DEFAULT_EXPORT = {"kv_cache_group": [], "min_kv_scale": 0.0, "pack_method": "reorder",
                  "weight_format": "real_quantized", "weight_merge_groups": None}
LAYER_CONFIG_KEYS = ("input_tensors", "output_tensors", "weight", "bias")


def _never_quantized_everywhere() -> list[list[re.Pattern]]:
    return [[re.compile(p) for p in profile.rules.never_quantized] for profile in engines.all_profiles()]


def fixed_config(config: dict, modules) -> dict:
    config = copy.deepcopy(config)
    q = config.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != "quark":
        raise QuantError("config.json: no Quark quantization_config to fix (quant_method must be 'quark')")
    export = q.get("export") if isinstance(q.get("export"), dict) else {}
    q["export"] = {**DEFAULT_EXPORT, **export}
    if not isinstance(q["export"].get("kv_cache_group"), list):
        q["export"]["kv_cache_group"] = []
    for key in ("layer_quant_config", "layer_type_quant_config"):
        if not isinstance(q.get(key), dict):
            q[key] = {}
    layer_cfgs = [q.get("global_quant_config"), *q["layer_quant_config"].values(),
                  *q["layer_type_quant_config"].values()]
    for layer_cfg in layer_cfgs:
        if isinstance(layer_cfg, dict):
            for key in LAYER_CONFIG_KEYS:
                layer_cfg.setdefault(key, None)
    q.pop("packed_modules_mapping", None)

    exclude = [str(e) for e in q.get("exclude")] if isinstance(q.get("exclude"), list) else []
    wanted: dict[str, None] = dict.fromkeys(exclude)
    for entry in exclude:
        if is_glob(entry):
            wanted[glob_to_regex(entry)] = None
    never = _never_quantized_everywhere()
    drafts = [p for p in engines.all_profiles() if p.rules.mtp.draft_naming == "nextn"]
    coarse = {p.draft_moe_coarse() for p in drafts}
    quantized_names: set[str] = set()
    float_draft_experts: set[str] = set()
    for name, mod in modules.items():
        if not mod.is_linear:
            continue
        aliases = engines.exclude_aliases(name, config)
        if stored_family(mod) == "float":
            float_draft_experts |= coarse & set(aliases)
            if any(not any(rx.search(name) for rx in patterns) for patterns in never):
                wanted.update(dict.fromkeys(aliases))
        else:
            quantized_names.update(aliases)
    quantized_names -= float_draft_experts  # a coarse draft prefix stays while any MTP expert is stored BF16
    q["exclude"] = [e for e in wanted if e not in quantized_names]

    mtp = engines.mtp_layers(config)
    if len(mtp):
        prefix = f"model.layers.{mtp.start}."
        lqc = q["layer_quant_config"]
        for key in list(lqc):
            if key.startswith(prefix):
                for p in drafts:
                    lqc.setdefault(p.nextn_checkpoint_name(key, prefix[:-1]), lqc[key])
    return config


def fix_config(path: str | Path, out_config: str | Path) -> Path:
    """Write the corrected config.json of checkpoint `path` (a directory, or an open Checkpoint: quant.hub's) to
    `out_config` (refuses the original)."""
    out = Path(out_config)
    if isinstance(path, Checkpoint):
        ckpt = path
    else:
        root = Path(path)
        if out.resolve() == (root / "config.json").resolve():
            raise QuantError(f"{out}: refusing to overwrite the checkpoint's own config.json; write elsewhere")
        ckpt = open_checkpoint(root)
    config = fixed_config(ckpt.config, inventory(ckpt))
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(config, indent=2) + "\n")
    return out
