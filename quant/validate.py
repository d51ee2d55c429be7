"""One validation of a checkpoint's config.json (its Quark config too) against itself and its tensors, run by
quantize, verify-manifest and eval before any work.

Two kinds of problem, two exit codes (README):
- the checkpoint is not valid (UnreadableCheckpoint, exit 2): a config.json value the tool computes with of the
  wrong type or range, a missing or non-string `model_type`, a malformed Quark config, a count that more layers
  than the tensor names hold. `validate_config` raises the first when a checkpoint is opened
  (`quant.checkpoint.open_checkpoint`), so every later stage works on values of the right type.
- an engine would fail or load wrong weights (exit 1): the config and the tensors disagree. `model_type` is not
  one transformers' AutoConfig knows (engines build their config through it), a layer the config declares has
  no tensor, a weight the config sizes is not a non-empty 2-D tensor, a routed expert is missing or shaped
  unlike the config. `consistency_findings` lists them (verify-manifest reports them among its findings);
  `require_valid` raises the first (quantize and eval, before anything is written or generated).

Every check costs time bounded by the number of tensors, never by a number in the config: counts are compared
with what the tensor names show, and the examples named in a message are found by scanning at most a few more
indices than there are tensors. Vision-language wrappers (Qwen3.5: text_config, model.language_model.*,
model.visual.*, mtp.*) are checked through their text config and language-model names.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from quant.checkpoint import text_config
from quant.errors import QuantError, UnreadableCheckpoint

# key -> smallest allowed value; checked in the config and in its text_config (VL wrappers).
COUNTS = {
    "num_hidden_layers": 1, "hidden_size": 1, "vocab_size": 1, "num_attention_heads": 1,
    "num_key_value_heads": 1, "head_dim": 1, "intermediate_size": 1, "moe_intermediate_size": 1,
    "shared_expert_intermediate_size": 1, "n_routed_experts": 1, "num_experts": 1, "num_local_experts": 1,
    "num_experts_per_tok": 1, "n_shared_experts": 0, "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1,
    "q_lora_rank": 1, "kv_lora_rank": 1, "qk_rope_head_dim": 1, "qk_nope_head_dim": 1, "v_head_dim": 1,
    "index_n_heads": 1, "index_head_dim": 1, "num_nextn_predict_layers": 0, "mtp_num_hidden_layers": 0,
}
NULLABLE = {"q_lora_rank", "head_dim", "intermediate_size", "n_shared_experts", "first_k_dense_replace", "n_group",
            "topk_group", "num_nextn_predict_layers", "mtp_num_hidden_layers"}
MTP_COUNTS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
EXPERT_COUNTS = ("n_routed_experts", "num_experts", "num_local_experts")
TENSOR_SPECS = ("input_tensors", "output_tensors", "weight", "bias")
# A decoder layer of the language model: model.layers.N (and the VL wrapper's model.language_model.layers.N,
# the runtime language_model.model.layers.N); not a vision tower's layers, not mtp.layers.N.
LM_LAYER = re.compile(r"^(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+)\.")
SHOWN = 5  # examples named in a message


def _short(value) -> str:
    return f"{value!r:.40}"


# ------------------------------------------------------------------------------------- not a valid checkpoint


def _check_counts(section: dict, where: str) -> None:
    for key, least in COUNTS.items():
        if key not in section:
            continue
        value = section[key]
        if value is None and key in NULLABLE:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise UnreadableCheckpoint(f"{where}: '{key}' must be an integer, got {_short(value)}")
        if value < least:
            raise UnreadableCheckpoint(f"{where}: '{key}' must be at least {least}, got {value}")


def _check_layer_config(layer: object, where: str) -> None:
    """A Quark QLayerConfig: each tensor spec is null, an object or a list of objects (two-stage schemes)."""
    if not isinstance(layer, dict):
        raise UnreadableCheckpoint(f"{where} must be an object, got {_short(layer)}")
    for key in TENSOR_SPECS:
        spec = layer.get(key)
        specs = spec if isinstance(spec, list) else [spec]
        if not all(s is None or isinstance(s, dict) for s in specs):
            raise UnreadableCheckpoint(f"{where}.{key} must be null, an object or a list of objects, "
                                       f"got {_short(spec)}")


def _check_names(value, where: str, what: str) -> None:
    if value is not None and not (isinstance(value, list) and all(isinstance(e, str) for e in value)):
        raise UnreadableCheckpoint(f"{where} must be a list of {what}, got {_short(value)}")


def _check_quantization_config(q: dict, where: str) -> None:
    method = q.get("quant_method")
    if method is not None and not isinstance(method, str):
        raise UnreadableCheckpoint(f"{where}.quant_method must be a string, got {_short(method)}")
    if method == "fp8":
        _check_names(q.get("modules_to_not_convert"), f"{where}.modules_to_not_convert", "module names")
        block = q.get("weight_block_size")
        if block is not None and not (isinstance(block, list) and len(block) == 2 and all(
                isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise UnreadableCheckpoint(f"{where}.weight_block_size must be two positive integers, "
                                       f"got {_short(block)}")
    if method != "quark":
        return
    _check_names(q.get("exclude"), f"{where}.exclude", "module names")
    if q.get("global_quant_config") is not None:
        _check_layer_config(q["global_quant_config"], f"{where}.global_quant_config")
    for key in ("layer_quant_config", "layer_type_quant_config"):
        table = q.get(key)
        if table is None:
            continue
        if not isinstance(table, dict):
            raise UnreadableCheckpoint(f"{where}.{key} must be an object, got {_short(table)}")
        for name, layer in table.items():
            _check_layer_config(layer, f"{where}.{key}[{name!r}]")


def _check_model_type(config: dict, where: str) -> None:
    """What transformers' AutoConfig needs before it can pick a config class (5.x: a missing model_type is a
    ValueError, a list a TypeError): a non-empty string. Whether it names a known class is an engine matter
    (`consistency_findings`)."""
    if "model_type" not in config:
        raise UnreadableCheckpoint(f"{where}: no 'model_type' (transformers' AutoConfig and the engines choose the "
                                   "model class by it)")
    for section, label in ((config, "model_type"), (config.get("text_config") or {}, "text_config.model_type")):
        value = section.get("model_type")
        if "model_type" in section and not (isinstance(value, str) and value.strip()):
            raise UnreadableCheckpoint(f"{where}: '{label}' must be a non-empty string, got {_short(value)}")


def lm_layer_indices(tensor_names) -> set[int]:
    """Decoder-layer indices of the language model the tensor names hold (at most one per tensor)."""
    out = set()
    for name in tensor_names:
        m = LM_LAYER.match(name)
        if m:
            out.add(int(m.group(1)))
    return out


def validate_config(config: dict, path: Path, tensor_names=()) -> None:
    """Raise UnreadableCheckpoint for the first value of `config` (read from `path`) with a wrong type or range,
    or a count beyond what `tensor_names` can hold."""
    where = str(path)
    for key in ("quantization_config", "text_config"):
        if key in config and config[key] is not None and not isinstance(config[key], dict):
            raise UnreadableCheckpoint(f"{where}: '{key}' must be an object, got {_short(config[key])}")
    _check_model_type(config, where)
    archs = config.get("architectures")
    if archs is not None and not (isinstance(archs, list) and archs and all(isinstance(a, str) for a in archs)):
        raise UnreadableCheckpoint(f"{where}: 'architectures' must be a non-empty list of class names, "
                                   f"got {_short(archs)}")
    if isinstance(config.get("quantization_config"), dict):
        _check_quantization_config(config["quantization_config"], f"{where}: quantization_config")
    _check_counts(config, where)
    text = config.get("text_config")
    if isinstance(text, dict):
        _check_counts(text, f"{where}: text_config")
    merged = text_config(config)
    names = list(tensor_names)
    # Any layer-like index counts here (mtp.layers.N too): a bound on loops over declared MTP layers.
    layers = {int(n) for name in names for n in _layer_numbers(name)}
    for key in MTP_COUNTS:
        count = merged.get(key) or 0
        if count > max(len(layers), 64):
            raise UnreadableCheckpoint(f"{where}: '{key}' is {count}, more layers than the checkpoint's tensor "
                                       f"names hold ({len(layers)} layer indices)")


def _layer_numbers(name: str):
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            yield parts[i + 1]


# ---------------------------------------------------------------------------------- an engine would fail


@functools.lru_cache(maxsize=1)
def known_model_types() -> frozenset[str] | None:
    """The model types transformers' AutoConfig maps to a config class (CONFIG_MAPPING_NAMES), read from the
    installed transformers' generated table without importing the package (which imports torch); None when
    transformers is not installed or the table cannot be found."""
    import importlib.util
    import runpy

    try:
        spec = importlib.util.find_spec("transformers")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    table = Path(spec.origin).parent / "models" / "auto" / "auto_mappings.py"
    try:
        names = runpy.run_path(str(table))["CONFIG_MAPPING_NAMES"]
    except Exception:  # noqa: BLE001 - another transformers layout: ask the package itself
        try:
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES as names
        except Exception:  # noqa: BLE001
            return None
    # AutoConfig adds "gpt-sw3" (configuration_auto.py); no MoE family, listed for completeness.
    return frozenset(names) | {"gpt-sw3"}


def _transformers_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return "?"


def _missing_indices(present: set[int], count: int) -> tuple[int, list[int]]:
    """(how many of 0..count-1 are not in `present`, the first few of them), scanning no further than the
    number of present indices allows."""
    missing = count - sum(1 for i in present if i < count)
    shown = [i for i in range(min(count, len(present) + SHOWN)) if i not in present][:SHOWN]
    return missing, shown


def _listing(missing: int, shown: list[int]) -> str:
    return ", ".join(map(str, shown)) + (" ..." if missing > len(shown) else "")


def consistency_findings(ckpt, shape_of=None) -> list:
    """Where config.json and the tensors disagree so that an engine would fail or load wrong weights (see the
    module docstring), as preflight findings (engine "all")."""
    from quant.verify.report import Finding
    from quant.verify.shapes import config_shapes, layout_findings

    config = ckpt.config
    cfg = text_config(config)
    out: list = []
    model_type = config.get("model_type")
    known = known_model_types()
    auto_map = config.get("auto_map")
    remote = isinstance(auto_map, dict) and "AutoConfig" in auto_map
    if known is not None and isinstance(model_type, str) and model_type not in known and not remote:
        out.append(Finding("error", "all", (), "config.json:model_type",
                           f"model_type {model_type!r} is not one transformers {_transformers_version()} knows: "
                           "AutoConfig (which SGLang, vLLM and transformers build the config with) raises "
                           "ValueError", "use the model_type of the architecture (or an auto_map for remote code)",
                           "config consistency"))
    layers = cfg.get("num_hidden_layers")
    if isinstance(layers, int) and not isinstance(layers, bool) and layers > 0:
        present = lm_layer_indices(ckpt.tensors)
        missing, shown = _missing_indices(present, layers)
        if present and missing:
            out.append(Finding("error", "all", (), f"model.layers.{shown[0]}.*",
                               f"config.json declares {layers} decoder layers (num_hidden_layers) but no tensor "
                               f"of {missing} of them is stored (layers {_listing(missing, shown)}): the engines "
                               "build every declared layer and have nothing to load into these",
                               "set num_hidden_layers to the layers the checkpoint holds, or export the missing "
                               "layers", "config consistency"))
    shape_of = shape_of or config_shapes(config)
    out += layout_findings(ckpt, shape_of)
    out += _expert_shape_findings(ckpt, shape_of)
    return out


def _expert_shape_findings(ckpt, shape_of) -> list:
    """Routed experts of an unquantized checkpoint whose [out, in] is not the config's: every engine allocates
    each expert from config.json and copies the stored one in. Quantized checkpoints store other shapes (packed
    MXFP4, scale grids); the preflight's tensor contracts check those."""
    from quant.verify.report import Finding

    if ckpt.config.get("quantization_config"):
        return []
    out = []
    for name, info in sorted(ckpt.tensors.items()):
        if ".experts." not in name or not name.endswith(".weight") or len(info.shape) != 2:
            continue
        want = shape_of(name[: -len(".weight")])
        if want and tuple(info.shape) != tuple(want) and 0 not in info.shape:
            out.append(Finding("error", "all", (), name, f"{name} is {info.dtype} {list(info.shape)}, but the "
                               f"engines size this expert {list(want)} from config.json",
                               f"re-export the expert as {list(want)} or correct config.json", "tensor layout"))
    return out


def require_valid(ckpt) -> None:
    """Raise a one-line error for a checkpoint quantize or eval cannot work on: an integrity problem of its
    index and shards (`Checkpoint.problems`), else the first consistency finding (how many more, too)."""
    ckpt.require_intact()
    errors = [f for f in consistency_findings(ckpt) if f.severity == "error"]
    if errors:
        more = f" (and {len(errors) - 1} more like it; `quant verify-manifest` lists them)" if len(errors) > 1 else ""
        raise QuantError(f"{ckpt.root}: {errors[0].message}{more}")
