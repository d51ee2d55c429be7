"""`quantization_config` schema checks (the keys vLLM / SGLang quark/quark.py QuarkConfig and amd/Quark
QConfig.from_dict index) and scheme classification (QuarkConfig's _is_* predicates)."""

from __future__ import annotations

import fnmatch

from quant.engines import Profile
from quant.families import family_for_config, lookup_family
from quant.verify.report import Finding
from quant.verify.shapes import engine_registered, known_model_types

QCFG = "config.json:quantization_config"


def _finding(profile: Profile | None, tensor: str, message: str, fix: str, severity: str = "error",
             rule: str = "config schema") -> Finding:
    engine, versions = (profile.engine, (profile.release,)) if profile else ("all", ())
    return Finding(severity, engine, versions, tensor, message, fix, rule)


def classify(layer_cfg: dict | None) -> str:
    """Scheme of a QLayerConfig as the engines' predicates see it (quark.py _is_mx_fp4, _is_w_ocp_mx_a_x,
    _is_fp8_w8a8, _is_w4a8_mxfp4_fp8; MXFP8: _mxfp8_kind); "unmodelled" for dtypes this preflight has no contract
    for."""
    if not isinstance(layer_cfg, dict):
        return "other"
    if layer_cfg.get("output_tensors") or layer_cfg.get("bias"):
        return "quantized_output_or_bias"
    w, a = layer_cfg.get("weight"), layer_cfg.get("input_tensors")
    if w is None:
        return "other"
    if isinstance(w, list) or isinstance(a, list):
        return "unmodelled"
    dtype = w.get("dtype")
    if dtype == "fp4":
        if not (w.get("qscheme") == "per_group" and w.get("group_size") == 32 and w.get("scale_format") == "e8m0"
                and w.get("is_dynamic") is not True):
            return "other"
        if a is None:
            return "mxfp4_weight_only"
        if a.get("dtype") == "fp4" and a.get("qscheme") == "per_group" and a.get("group_size") == 32 \
                and a.get("scale_format") == "e8m0":
            return "mxfp4_static_input" if a.get("is_dynamic") is False else "mxfp4"
        if a.get("dtype") in ("fp8_e4m3", "fp8_e4m3fn") and a.get("qscheme") == "per_tensor" \
                and not a.get("is_dynamic"):
            return "w4a8_mxfp4_fp8"
        return "other"
    if dtype == "fp8_e4m3" and _mx_block_spec(w):
        return _mxfp8_kind(w, a)
    if dtype == "fp8_e4m3":
        if w.get("is_dynamic") or w.get("qscheme") not in ("per_tensor", "per_channel"):
            return "other"
        if a is None:
            return "fp8_weight_only"
        if a.get("dtype") == "fp8_e4m3" and (a.get("is_dynamic") or a.get("qscheme") == "per_tensor"):
            return "fp8"
        return "other"
    return "unmodelled"


def _mx_block_spec(spec: dict) -> bool:
    """An OCP MX tensor spec as Quark writes it: one E8M0 scale per 32 inputs (per_group, group_size 32, e8m0), or
    the 2-D spelling of an MXFP8 weight (per_block, block_size [R, 32], scale_type float8_e8m0fnu: DeepSeek-V4.1)."""
    if spec.get("qscheme") == "per_group":
        return spec.get("group_size") == 32 and spec.get("scale_format") == "e8m0"
    block = spec.get("block_size")
    return spec.get("qscheme") == "per_block" and isinstance(block, list) and len(block) == 2 and block[1] == 32 \
        and spec.get("scale_type") == "float8_e8m0fnu"


def _mxfp8_kind(w: dict, a: dict | None) -> str:
    """MXFP8 (OCP E4M3 elements, E8M0 scales per 32 inputs) with dynamic FP8 activations, as vLLM's QuarkOCP_MX reads
    it (engine rules `schemes`): "mxfp8" for [1, 32] weights with MXFP8 activations (also what 0.33's
    QuarkW8A8Mxfp8MoEMethod takes), "mxfp8_block" for the 2-D [R, 32] spelling (symmetric, DeepSeek-V4.1's [32, 32]).
    Other spellings (weight-only, static activations) take engine paths this preflight has no contract for."""
    if w.get("is_dynamic") or not (isinstance(a, dict) and a.get("dtype") == "fp8_e4m3" and a.get("is_dynamic")):
        return "unmodelled"
    if w.get("qscheme") == "per_block":
        return "mxfp8_block" if w.get("symmetric") is True else "unmodelled"
    return "mxfp8" if a.get("qscheme") == "per_group" and a.get("group_size") == 32 else "unmodelled"


def config_problems(config: dict) -> tuple[list[Finding], bool]:
    """Engine-independent checks; the bool says whether per-engine checks can go on (a Quark config exists)."""
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        return [_finding(None, QCFG, "config.json has no quantization_config: engines load the checkpoint "
                         "as unquantized and every U8/F8 weight fails", "write the Quark quantization_config")], False
    if q.get("quant_method") != "quark":
        return [_finding(None, f"{QCFG}.quant_method",
                         f"quant_method is {q.get('quant_method')!r}, not 'quark': this preflight checks Quark "
                         "checkpoints only", "verify with the loader of that format")], False
    out: list[Finding] = []
    if not isinstance(q.get("global_quant_config"), dict):
        out.append(_finding(None, f"{QCFG}.global_quant_config", "global_quant_config is missing or not an "
                            "object: every engine reads it for modules no other entry covers",
                            "add the global QLayerConfig"))
    export = q.get("export")
    if isinstance(export, dict) and export.get("weight_format", "real_quantized") != "real_quantized":
        out.append(_finding(None, f"{QCFG}.export.weight_format",
                            f"weight_format is {export.get('weight_format')!r}: engines expect packed "
                            "real_quantized weights", "export with weight_format 'real_quantized'"))
    return out, True


def model_config_problems(config: dict, profile: Profile) -> list[Finding]:
    """What the engine's config class refuses in config.json before any weight is read, whatever the checkpoint's
    format: a layer_types list (top level or text_config) of another length than num_hidden_layers
    (engine rules layer_types_length; intel/auto-round#1984 wrote one)."""
    error = profile.rules.layer_types_length
    out: list[Finding] = unparsed_model_type(config, profile)
    for where, cfg in (("config.json:", config), ("config.json:text_config.", config.get("text_config"))):
        if not error or not isinstance(cfg, dict):
            continue
        types, layers = cfg.get("layer_types"), cfg.get("num_hidden_layers")
        if isinstance(types, list) and isinstance(layers, int) and len(types) != layers:
            out.append(_finding(
                profile, f"{where}layer_types",
                f"layer_types has {len(types)} entries and num_hidden_layers is {layers}: {profile.title} raises "
                f"{error.format(layers=layers, types=len(types))} reading config.json",
                f"write one layer_types entry per decoder layer ({layers}; MTP layers are not listed)",
                rule="layer_types length"))
    return out


def unparsed_model_type(config: dict, profile: Profile) -> list[Finding]:
    """A model_type this release cannot read config.json of: neither its own config classes (engine rules
    config_registry) nor the transformers it runs with (its `transformers` requirement against the family's
    `transformers_since`) know it. A type no transformers release knows is judged by the project's transformers
    and the other releases' registries, as before."""

    model_type, auto_map = config.get("model_type"), config.get("auto_map")
    if not isinstance(model_type, str) or model_type in profile.rules.config_registry or \
            (isinstance(auto_map, dict) and "AutoConfig" in auto_map):
        return []
    since = family_for_config(config).transformers_since.get(model_type) if lookup_family(config) else None
    if since is not None:
        if profile.rules.transformers is None or profile.parses(model_type, since):
            return []
        first = profile.first_release_parsing(model_type, since)
        return [_finding(profile, "config.json:model_type",
                         f"{profile.title} {profile.release} runs transformers{profile.rules.transformers} (its "
                         f"wheel's requirement), which does not know model_type {model_type!r} (transformers knows it "
                         f"from {since}), and registers no config class of its own for it: reading config.json raises "
                         f"'model type `{model_type}` but Transformers does not recognize this architecture' before "
                         "any weight is read",
                         f"serve it with {first} or newer" if first else "no profiled release of this engine reads it",
                         rule="release cannot parse")]
    known = known_model_types()
    if known is None or model_type in known:
        return []
    registered = engine_registered(model_type)
    if not registered or profile.label in registered:
        return []  # no release registers it: consistency_findings reports it for every engine
    return [_finding(profile, "config.json:model_type",
                     f"model_type {model_type!r} has no config class in {profile.title} {profile.release} (it is "
                     f"registered by {', '.join(registered)}; transformers' AutoConfig does not know it): reading "
                     "config.json raises before any weight is read",
                     f"serve it with a release that registers it ({', '.join(registered)})",
                     rule="engine config registry")]


def profile_config_problems(config: dict, profile: Profile) -> list[Finding]:
    q = config["quantization_config"]
    rules = profile.rules.config_schema
    out: list[Finding] = []
    who = profile.title

    def err(key: str, message: str, fix: str, severity: str = "error") -> None:
        out.append(_finding(profile, f"{QCFG}.{key}", message, fix, severity))

    export = q.get("export")
    if rules.export_required:
        if not isinstance(export, dict):
            err("export", f"{who} raises {rules.export_required}", "add export: {kv_cache_group: [], "
                "pack_method: reorder, weight_format: real_quantized, min_kv_scale: 0.0}")
        elif not isinstance(export.get("kv_cache_group"), list):
            err("export.kv_cache_group", f"{who} raises {rules.kv_cache_group_list}",
                "set export.kv_cache_group to a list ([] without an FP8 KV cache)")
    if "exclude" not in q and rules.exclude_required:
        err("exclude", f"{who} iterates the exclude list: a missing 'exclude' raises TypeError/KeyError",
            "add exclude: [] (or the list of unquantized modules)")
    elif "exclude" in q and not isinstance(q.get("exclude"), list):
        err("exclude", f"exclude is {type(q.get('exclude')).__name__}, {who} needs a list",
            "make exclude a list of names or re: patterns")
    for key in rules.dict_keys:
        if not isinstance(q.get(key), dict):
            err(key, f"{key} is missing or not an object: {who} iterates it (AttributeError/TypeError)",
                f"add {key}: {{}}")
    for key in rules.required_keys:
        if key not in q:
            err(key, f"Quark QConfig.from_dict indexes config_dict[{key!r}] (KeyError)", f"add {key}")
    if rules.layer_config_keys:
        for where, layer_cfg in _layer_configs(q):
            if not isinstance(layer_cfg, dict):
                continue
            missing = [k for k in rules.layer_config_keys if k not in layer_cfg]
            if missing:
                err(where, f"Quark QLayerConfig.from_dict indexes {missing} (KeyError); all four tensor keys "
                    "must be present, null when unused", f"add {', '.join(f'{k}: null' for k in missing)}")
            for tkey in ("weight", "input_tensors", "output_tensors", "bias"):
                specs = layer_cfg.get(tkey)
                for spec in specs if isinstance(specs, list) else [specs]:
                    if isinstance(spec, dict) and "dtype" not in spec:
                        err(f"{where}.{tkey}", "Quark QTensorConfig.from_dict requires 'dtype' (KeyError)",
                            "add the tensor dtype")
    if rules.loader_overrides_packed_mapping and "packed_modules_mapping" in q:
        err("packed_modules_mapping", f"{who}'s loader injects packed_modules_mapping and overwrites this one",
            "remove packed_modules_mapping from the checkpoint config", severity="warning")
    out.extend(_kv_cache_problems(q, profile))
    return out


def _layer_configs(q: dict):
    yield "global_quant_config", q.get("global_quant_config")
    for section in ("layer_quant_config", "layer_type_quant_config"):
        if isinstance(q.get(section), dict):
            for key, value in q[section].items():
                yield f"{section}[{key!r}]", value


def _kv_cache_problems(q: dict, profile: Profile) -> list[Finding]:
    export = q.get("export") if isinstance(q.get("export"), dict) else {}
    group = export.get("kv_cache_group")
    mode = profile.rules.config_schema.kv_cache_keys
    if not mode or not isinstance(group, list) or not group:
        return []
    lqc = q.get("layer_quant_config") if isinstance(q.get("layer_quant_config"), dict) else {}
    if mode == "exact":
        matched = [lqc[k] for k in group if k in lqc]
        ok = set(group) <= set(lqc)
    else:
        matched = [v for k, v in lqc.items() if any(fnmatch.fnmatchcase(k, p) for p in group)]
        ok = set(group) <= set(lqc) or bool(matched)
    key = f"{QCFG}.export.kv_cache_group"
    if not ok:
        return [_finding(profile, key, f"{profile.title} raises ValueError(\"The Quark quantized model has the "
                         "kv_cache_group parameter setting, but no kv_cache quantization settings were found in "
                         "the quantization configuration.\")",
                         "add layer_quant_config entries keyed exactly like kv_cache_group, or empty the group",
                         rule="kv cache")]
    outs = [m.get("output_tensors") if isinstance(m, dict) else None for m in matched]
    if any(o != outs[0] for o in outs) or not isinstance(outs[0], dict):
        return [_finding(profile, key, "kv_cache_group layer configs disagree or have no output_tensors: "
                         f"{profile.title} raises ValueError", "give every KV entry the same fp8 output_tensors",
                         rule="kv cache")]
    spec = outs[0]
    if spec.get("dtype") != "fp8_e4m3" or spec.get("qscheme") != "per_tensor":
        return [_finding(profile, key, f"KV-cache spec {spec.get('dtype')}/{spec.get('qscheme')}: "
                         f"{profile.title} raises NotImplementedError (fp8_e4m3 per_tensor only)",
                         "use an fp8_e4m3 per_tensor KV-cache spec", rule="kv cache")]
    return []
