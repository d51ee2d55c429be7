"""Types and ranges of the config.json keys the tool computes with, checked once when a checkpoint is opened.

Every reader (quantize's plan, the preflight, the eval backends) then works on values of the right type: a
wrong one is a one-line UnreadableCheckpoint naming the key (exit 2, "not a valid checkpoint") instead of a
traceback deep in a later stage. Counts that drive loops (MTP layers) are bounded by what the tensor names show,
so a config cannot make the work grow beyond the checkpoint's size.
"""

from __future__ import annotations

from pathlib import Path

from quant.errors import UnreadableCheckpoint

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


def _check_counts(section: dict, where: str) -> None:
    for key, least in COUNTS.items():
        if key not in section:
            continue
        value = section[key]
        if value is None and key in NULLABLE:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise UnreadableCheckpoint(f"{where}: '{key}' must be an integer, got {value!r:.40}")
        if value < least:
            raise UnreadableCheckpoint(f"{where}: '{key}' must be at least {least}, got {value}")


TENSOR_SPECS = ("input_tensors", "output_tensors", "weight", "bias")


def _check_layer_config(layer: object, where: str) -> None:
    """A Quark QLayerConfig: each tensor spec is null, an object or a list of objects (two-stage schemes)."""
    if not isinstance(layer, dict):
        raise UnreadableCheckpoint(f"{where} must be an object, got {layer!r:.40}")
    for key in TENSOR_SPECS:
        spec = layer.get(key)
        specs = spec if isinstance(spec, list) else [spec]
        if not all(s is None or isinstance(s, dict) for s in specs):
            raise UnreadableCheckpoint(f"{where}.{key} must be null, an object or a list of objects, "
                                       f"got {spec!r:.40}")


def _check_quark(q: dict, where: str) -> None:
    if q.get("quant_method") != "quark":
        return
    exclude = q.get("exclude")
    if exclude is not None and not (isinstance(exclude, list) and all(isinstance(e, str) for e in exclude)):
        raise UnreadableCheckpoint(f"{where}.exclude must be a list of module names, got {exclude!r:.40}")
    if q.get("global_quant_config") is not None:
        _check_layer_config(q["global_quant_config"], f"{where}.global_quant_config")
    for key in ("layer_quant_config", "layer_type_quant_config"):
        table = q.get(key)
        if table is None:
            continue
        if not isinstance(table, dict):
            raise UnreadableCheckpoint(f"{where}.{key} must be an object, got {table!r:.40}")
        for name, layer in table.items():
            _check_layer_config(layer, f"{where}.{key}[{name!r}]")


def validate_config(config: dict, path: Path, tensor_names=()) -> None:
    """Raise UnreadableCheckpoint for the first key of `config` (read from `path`) with a wrong type or range."""
    where = str(path)
    model_type = config.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise UnreadableCheckpoint(f"{where}: 'model_type' must be a string, got {model_type!r:.40}")
    archs = config.get("architectures")
    if archs is not None and not (isinstance(archs, list) and archs and all(isinstance(a, str) for a in archs)):
        raise UnreadableCheckpoint(f"{where}: 'architectures' must be a non-empty list of class names, "
                                   f"got {archs!r:.40}")
    for key in ("quantization_config", "text_config"):
        if key in config and config[key] is not None and not isinstance(config[key], dict):
            raise UnreadableCheckpoint(f"{where}: '{key}' must be an object, got {config[key]!r:.40}")
    if isinstance(config.get("quantization_config"), dict):
        _check_quark(config["quantization_config"], f"{where}: quantization_config")
    _check_counts(config, where)
    text = config.get("text_config")
    if isinstance(text, dict):
        _check_counts(text, f"{where}: text_config")
    merged = {**config, **text} if isinstance(text, dict) else config
    layers = {int(part) for name in tensor_names for part in _layer_numbers(name)}
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
