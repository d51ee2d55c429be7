"""The output schemes: how a weight is quantized, which tensors it becomes, and how it reads back.

One table (`SCHEMES`); the Quark tensor specs that describe each scheme in config.json live in quark_config.py.
Planning needs only the table, so torch and the numerics load when a weight is first quantized: the quantize
command hashes the source while they load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from quant.engine_rules import SchemeKind
from quant.errors import QuantError, did_you_mean

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Scheme:
    name: str
    description: str
    k_multiple: int  # the input dim must be a multiple of this (MXFP4 blocks)
    output_format: str  # "quark" or "fp8-official"
    quantize: Callable[[torch.Tensor, str], dict[str, torch.Tensor]]  # (weight, scale_mode) -> {suffix: tensor}
    dequantize: Callable[[dict[str, torch.Tensor]], torch.Tensor]  # {suffix: tensor} -> fp32 weight
    rows: Callable[[dict[str, torch.Tensor], torch.Tensor], dict[str, torch.Tensor]]  # parts of some rows
    row_align: int = 1  # rows() takes whole windows of this many rows
    # (sum of squared errors, sum of squares) of weight rows against their parts; None: dequantize and compare
    error_sums: Callable[[torch.Tensor, dict[str, torch.Tensor]], tuple[float, float]] | None = None
    # Its kind in the engines' scheme tables (engine rules `schemes`: the kind verify-manifest classifies the
    # written layer config as); None for a format outside them (block FP8: every serving engine's releases).
    engine_kind: SchemeKind | None = None

    @property
    def engines(self) -> tuple[str, ...]:
        """The engine releases that load this scheme, read from the engine rules: each serving engine's default
        releases whose Linear and FusedMoE both build `engine_kind`; an engine all of whose default releases do is
        named alone. The default self-check, the manifest's `scheme_loads_in` and the card's serve commands."""
        from quant.engines import select_profiles, serving_engines

        out: list[str] = []
        for engine in serving_engines():
            releases = select_profiles([engine])
            loading = [p.label for p in releases if self.engine_kind is None or all(
                table.get(self.engine_kind) == "ok" for table in (p.rules.schemes.linear, p.rules.schemes.moe))]
            out += [engine] if len(loading) == len(releases) else loading
        return tuple(out)


def _mxfp4(w: torch.Tensor, scale_mode: str) -> dict[str, torch.Tensor]:
    from quant.numerics import mxfp4

    packed, scales = mxfp4.quantize_mxfp4(w, mode=scale_mode)
    return {"weight": packed, "weight_scale": scales}


def _mxfp4_back(t: dict[str, torch.Tensor]) -> torch.Tensor:
    import torch

    from quant.numerics import mxfp4

    return mxfp4.dequantize_mxfp4(t["weight"], t["weight_scale"], dtype=torch.float32)


def _mxfp4_error(w: torch.Tensor, t: dict[str, torch.Tensor]) -> tuple[float, float]:
    from quant.numerics import mxfp4

    return mxfp4.quantization_error(w, t["weight"], t["weight_scale"])


def mxfp8_scale_mode(scale_mode: str) -> str:
    """The MXFP8 shared-exponent rule for a --scale-mode: even, floor and rceil as they are; MXFP4's per-block search
    has no MXFP8 counterpart here, so it falls back to even (Quark's default)."""
    from quant.numerics import mxfp8

    return scale_mode if scale_mode in mxfp8.SCALE_MODES else "even"


def _mxfp8(w: torch.Tensor, scale_mode: str) -> dict[str, torch.Tensor]:
    from quant.numerics import mxfp8

    q, scales = mxfp8.quantize_mxfp8(w, mode=mxfp8_scale_mode(scale_mode))
    return {"weight": q, "weight_scale": scales}


def _mxfp8_back(t: dict[str, torch.Tensor]) -> torch.Tensor:
    from quant.numerics import mxfp8

    return mxfp8.dequantize_mxfp8(t["weight"], t["weight_scale"])


def _fp8_channel(w: torch.Tensor, scale_mode: str) -> dict[str, torch.Tensor]:
    from quant.numerics import fp8

    q, s = fp8.quantize_fp8_per_channel(w)
    return {"weight": q, "weight_scale": s}


def _fp8_back(t: dict[str, torch.Tensor]) -> torch.Tensor:
    import torch

    from quant.numerics import fp8

    return fp8.dequantize_fp8(t["weight"], t["weight_scale"], dtype=torch.float32)


def _row_select(parts: dict[str, torch.Tensor], index: torch.Tensor) -> dict[str, torch.Tensor]:
    """The rows `index` of a row-wise scheme (MXFP4 blocks and per-channel scales run along rows)."""
    return {k: (v.index_select(0, index) if v.dim() else v) for k, v in parts.items()}


def _block_rows(parts: dict[str, torch.Tensor], index: torch.Tensor) -> dict[str, torch.Tensor]:
    """Whole 128-row tile rows (only the weight's last one may be short), in order."""
    import torch

    tiles = torch.unique_consecutive(index // 128)
    assert index.numel() == 0 or int(index[0]) % 128 == 0, "block-FP8 rows come in whole tile rows"
    return {"weight": parts["weight"].index_select(0, index),
            "weight_scale_inv": parts["weight_scale_inv"].index_select(0, tiles)}


def _fp8_block(w: torch.Tensor, scale_mode: str) -> dict[str, torch.Tensor]:
    from quant.numerics import fp8

    q, s = fp8.quantize_fp8_block(w)
    return {"weight": q, "weight_scale_inv": s}


def _fp8_block_back(t: dict[str, torch.Tensor]) -> torch.Tensor:
    import torch

    from quant.numerics import fp8

    return fp8.dequantize_fp8_block(t["weight"], t["weight_scale_inv"], dtype=torch.float32)


SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in [
        Scheme("w_mxfp4_a_mxfp4", "MXFP4 weights, dynamic MXFP4 activations (what AMD publishes)", 32, "quark",
               _mxfp4, _mxfp4_back, _row_select, error_sums=_mxfp4_error, engine_kind="mxfp4"),
        Scheme("w_mxfp4", "MXFP4 weights only, activations in BF16", 32, "quark", _mxfp4, _mxfp4_back,
               _row_select, error_sums=_mxfp4_error, engine_kind="mxfp4_weight_only"),
        # MXFP8 linears load in vLLM 0.31 to 0.33, MXFP8 experts only from vLLM 0.33 (QuarkW8A8Mxfp8MoEMethod);
        # SGLang 0.5.12 to 0.5.23 have no Quark MXFP8 scheme and amd-quark 0.13 (transformers) cannot run one
        # (engine rules `schemes`, kind mxfp8). As the scheme, the experts are MXFP8 too: the newest vLLM only (0.33).
        Scheme("w_mxfp8_a_mxfp8", "MXFP8 weights (OCP E4M3, one E8M0 scale per 32 inputs), dynamic MXFP8 "
               "activations (Quark OCP_MXFP8E4M3Spec)", 32, "quark", _mxfp8, _mxfp8_back, _row_select,
               engine_kind="mxfp8"),
        Scheme("fp8", "FP8 E4M3 per-channel weights, dynamic per-token FP8 activations (Quark ptpc_fp8)", 1,
               "quark", _fp8_channel, _fp8_back, _row_select, engine_kind="fp8"),
        Scheme("fp8-block", "FP8 E4M3 128x128 blocks with weight_scale_inv (DeepSeek/GLM official format)", 1,
               "fp8-official", _fp8_block, _fp8_block_back, _block_rows, row_align=128),
    ]
}

MXFP4_SCHEMES = tuple(name for name in SCHEMES if name.startswith("w_mxfp4"))  # what GPTQ can solve
DEFAULT_SCHEME = "w_mxfp4_a_mxfp4"  # quant quantize's --scheme when none is given (what AMD publishes)


# The names other tools give these schemes, accepted as given: llm-compressor's preset schemes
# (compressed_tensors/quantization/quant_scheme.py PRESET_SCHEMES: MXFP4 = group-32 FP4 weights with dynamic
# group-32 FP4 activations, MXFP4A16 weights only, MXFP8 likewise in FP8, FP8_DYNAMIC per-channel weights with
# dynamic per-token activations, FP8_BLOCK 128x128 weights with dynamic group-128 activations) and AMD Quark's
# (`mxfp4`; `ptpc_fp8`, per-tensor-per-channel FP8; the deprecated spellings of quark/torch/quantization/config
# DEPRECATED_QUANT_SCHEME).
ALIASES = {
    "MXFP4": ("w_mxfp4_a_mxfp4", "LLM Compressor"), "mxfp4": ("w_mxfp4_a_mxfp4", "Quark"),
    "w_mxfp4_a_mxfp4_sym": ("w_mxfp4_a_mxfp4", "Quark, deprecated"),
    "w_mx_fp4_a_mx_fp4_sym": ("w_mxfp4_a_mxfp4", "Quark, deprecated"),
    "MXFP4A16": ("w_mxfp4", "LLM Compressor"),
    "MXFP8": ("w_mxfp8_a_mxfp8", "LLM Compressor"), "w_mx_fp8_a_mx_fp8": ("w_mxfp8_a_mxfp8", "Quark, deprecated"),
    "FP8_DYNAMIC": ("fp8", "LLM Compressor"), "ptpc_fp8": ("fp8", "Quark"),
    "FP8_BLOCK": ("fp8-block", "LLM Compressor"),
}
# Names users bring that mean another scheme than any here (or than ours of the same spelling): refused, saying what
# to write instead.
OTHER_MEANINGS = {
    "FP8": "llm-compressor's FP8 is per-tensor static FP8 (calibrated weight and activation scales); this tool's "
           "per-channel weights with dynamic per-token activations are --scheme fp8 (llm-compressor's FP8_DYNAMIC), "
           "128x128 blocks --scheme fp8-block",
    "w_fp8_a_fp8": "Quark's w_fp8_a_fp8 is per-tensor FP8; this tool writes per-channel FP8 with dynamic per-token "
                   "activations (Quark's ptpc_fp8) as --scheme fp8, or the official 128x128 blocks as --scheme "
                   "fp8-block",
    "MXFP8A16": "weight-only MXFP8 has no scheme here (no engine profile loads it): --scheme w_mxfp8_a_mxfp8 "
                "quantizes the activations to MXFP8 too",
    "NVFP4": "NVFP4 (E4M3 scales per 16, a global scale) is read as a source, never written: --scheme "
             "w_mxfp4_a_mxfp4 is OCP MXFP4 (E8M0 scales per 32)",
    "NVFP4A16": "NVFP4 is read as a source, never written: --scheme w_mxfp4 is weight-only OCP MXFP4",
}


def scheme_name(name: str) -> str:
    """This tool's name for `name`: one of SCHEMES, or a peer's name for one of them (ALIASES, also in another
    case); a name meaning another scheme, or none, is refused in one line saying what to write."""
    if name in SCHEMES:
        return name
    alias = _any_case(ALIASES, name)
    if alias is not None:
        return alias[0]
    other = _any_case(OTHER_MEANINGS, name)
    if other is not None:
        raise QuantError(f"--scheme {name}: {other}")
    raise QuantError(f"unknown scheme {name!r}{did_you_mean(name, [*SCHEMES, *ALIASES])}; choose one of: "
                     f"{', '.join(SCHEMES)} (or a peer's name for one: {', '.join(ALIASES)})")


def _any_case(table: dict, name: str):
    """`table[name]`, else the entry whose key is `name` in another case, else None."""
    return table.get(name) or next((v for k, v in table.items() if k.lower() == str(name).lower()), None)


def get_scheme(name: str) -> Scheme:
    return SCHEMES[scheme_name(name)]


def secondary_scheme(primary: Scheme, treatment: str = "fp8") -> Scheme:
    """What a recipe's "fp8" or "mxfp8" role means next to the primary scheme. "fp8": per-channel FP8 in Quark
    checkpoints, block FP8 when the whole checkpoint is in the official block-FP8 format. "mxfp8": MXFP8 W8A8 (AMD's
    mixed releases: MXFP4 experts, MXFP8 elsewhere), which only a Quark checkpoint can hold."""
    if treatment == "mxfp8":
        if primary.output_format != "quark":
            raise QuantError(f"a recipe role 'mxfp8' needs a Quark scheme; {primary.name} writes the official "
                             "block-FP8 format, which has no MXFP8 layers")
        return SCHEMES["w_mxfp8_a_mxfp8"]
    return SCHEMES["fp8-block"] if primary.output_format == "fp8-official" else SCHEMES["fp8"]
