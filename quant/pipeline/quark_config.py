"""The `quantization_config` written into config.json.

Quark schema for Quark-format outputs (every key SGLang, vLLM and transformers/Quark read; see amd/Quark
quark/torch/quantization/config/config.py QConfig.to_dict / from_dict and the engines' quark/quark.py QuarkConfig),
or the DeepSeek/GLM official block-FP8 form for `fp8-block` outputs.
"""

from __future__ import annotations

from quant.planning.schemes import mxfp8_scale_mode

QUARK_SCHEMA_VERSION = "0.13"  # the amd-quark release whose QConfig.to_dict() layout this mirrors

_NULL_SPEC_FIELDS = {"group_size": None, "symmetric": None, "round_method": None, "scale_type": None,
                     "scale_format": None, "scale_calculation_mode": None, "mx_element_dtype": None,
                     "is_scale_quant": False}


def mxfp4_spec(is_dynamic: bool, scale_mode: str | None) -> dict:
    return {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "ch_axis": -1, "is_dynamic": is_dynamic,
            "symmetric": None, "round_method": "half_even", "scale_type": "float", "scale_format": "e8m0",
            "scale_calculation_mode": scale_mode, "mx_element_dtype": None, "observer_cls": "PerBlockMXObserver",
            "is_scale_quant": False}


def mxfp8_spec(is_dynamic: bool, scale_mode: str | None) -> dict:
    """amd-quark 0.13's OCP_MXFP8E4M3Spec(ch_axis=-1, is_dynamic=...).to_quantization_spec().to_dict(), key for key
    and in its order (quark/torch/quantization/config/config.py OCP_MXSpec.OCP_MX_SPEC_KWARGS and
    OCP_MXFP8E4M3Spec, :1467-1506; QTensorConfig.to_dict): what its exporter writes into config.json
    (quark/torch/export/api.py:326-336, quant_config.to_dict()). Quark 0.13 itself cannot export MXFP8 weights on
    CPU (hw_emulation_interface.py:1514 real_quantize_fp8_e4m3: "Unsupported QuantSchema: per_group"), so the
    tensors follow the engines' loaders: F8_E4M3 weight [out, in], U8 weight_scale [out, in/32]."""
    return {"dtype": "fp8_e4m3", "is_dynamic": is_dynamic, "qscheme": "per_group", "ch_axis": -1, "group_size": 32,
            "block_size": None, "symmetric": None, "round_method": "half_even", "scale_type": "float",
            "zero_point_type": "int32", "scale_format": "e8m0", "scale_calculation_mode": scale_mode,
            "mx_element_dtype": None, "observer_cls": "PerBlockMXObserver", "is_scale_quant": False,
            "enable_buffer_reuse": False, "max_input_numel": 4194304}


def fp8_channel_spec(ch_axis: int, is_dynamic: bool) -> dict:
    return {**_NULL_SPEC_FIELDS, "dtype": "fp8_e4m3", "qscheme": "per_channel", "ch_axis": ch_axis,
            "is_dynamic": is_dynamic, "observer_cls": "PerChannelMinMaxObserver"}


def _weight_scale_mode(scale_mode: str) -> str | None:
    # Weights are stored already quantized, so engines never recompute their scales; Quark only knows
    # "even"/"floor"/"ceil" and the true mode is recorded in quant_manifest.json.
    return scale_mode if scale_mode in ("even", "floor") else None


def layer_config(scheme: str, scale_mode: str) -> dict:
    """A Quark QLayerConfig dict: all five keys present, even when null (QLayerConfig.from_dict indexes them)."""
    if scheme == "w_mxfp4_a_mxfp4":
        weight, inputs = mxfp4_spec(False, _weight_scale_mode(scale_mode)), mxfp4_spec(True, "even")
    elif scheme == "w_mxfp4":
        weight, inputs = mxfp4_spec(False, _weight_scale_mode(scale_mode)), None
    elif scheme == "w_mxfp8_a_mxfp8":
        weight = mxfp8_spec(False, _weight_scale_mode(mxfp8_scale_mode(scale_mode)))
        inputs = mxfp8_spec(True, "even")
    elif scheme == "fp8":
        weight, inputs = fp8_channel_spec(0, False), fp8_channel_spec(1, True)
    else:
        raise ValueError(f"{scheme} is not a Quark scheme")
    return {"input_tensors": inputs, "output_tensors": None, "weight": weight, "bias": None, "target_device": None}


def quark_quantization_config(primary: str, scale_mode: str, exclude: list[str],
                              layer_patterns: dict[str, str]) -> dict:
    """`layer_patterns`: fnmatch pattern -> scheme for modules quantized with another scheme than `primary`.
    Patterns are globs over the module name (both engines fnmatch layer_quant_config keys), chosen so that
    they also match the engines' runtime names of MTP layers."""
    return {
        "quant_method": "quark",
        "quant_mode": "eager_mode",
        "version": QUARK_SCHEMA_VERSION,
        "algo_config": None,
        "softmax_quant_spec": None,
        "global_quant_config": layer_config(primary, scale_mode),
        "layer_type_quant_config": {},
        "layer_quant_config": {p: layer_config(s, scale_mode) for p, s in sorted(layer_patterns.items())},
        "kv_cache_quant_config": {},
        "kv_cache_post_rope": False,
        "exclude": list(exclude),
        "export": {"kv_cache_group": [], "min_kv_scale": 0.0, "pack_method": "reorder",
                   "weight_format": "real_quantized", "weight_merge_groups": None},
    }


def official_fp8_config(modules_to_not_convert: list[str]) -> dict:
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": [128, 128], "modules_to_not_convert": list(modules_to_not_convert)}
