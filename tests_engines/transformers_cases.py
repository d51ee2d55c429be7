"""The transformers tier's checkpoints and its engine: transformers 5.23 with amd-quark 0.13 loading our exports
through its own quantization integrations (QuarkHfQuantizer, FineGrainedFP8HfQuantizer) in `.venv-quark`
(tests_engines/transformers_probe.py), against `quant verify-manifest --engine transformers==5.23`. Shared by
tests_engines/test_transformers.py and scripts/engine_matrix.py --transformers."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from quant.pipeline import quantize_checkpoint
from quant.toy import build_toy
from quant.verify import verify_checkpoint
from tests_engines.probe_runner import run_probe
from tests_engines.cases import (ONE_SPELLING, TIER_OVERRIDES, activation_quantized_linears, mean_abs_diff, one_spelling,
                                 same_place)

ROOT = Path(__file__).resolve().parent.parent
QUARK_VENV = Path(os.environ.get("QUARK_VENV", ROOT / ".venv-quark"))
PROBE = Path(__file__).with_name("transformers_probe.py")
REFERENCE_PROBE = Path(__file__).with_name("reference_probe.py")
RELEASE = "transformers==5.23"
RECIPES = Path(__file__).with_name("recipes")
# Every family transformers 5.23 builds (GLM-5.3-Flash included; MiniMax-M3's minimax_m3_vl arrived in 5.24: the SGLang and vLLM tiers
# cover it).
TOYS = ("qwen3-moe", "deepseek-v3", "glm5", "qwen3.5", "glm4.7", "deepseek-v3.2", "kimi-k2.5", "minimax-m2", "glm5-next")
# (scheme, recipe): the vLLM tier's four export kinds, plus every linear but the routed experts in MXFP4 (the only
# Quark export transformers can load: it builds routed experts as fused BF16 parameters, the engine rules)
EXPORTS = (("w_mxfp4_a_mxfp4", "experts-only"), ("w_mxfp4_a_mxfp4", "all-linear"), ("w_mxfp4", "experts-only"),
           ("fp8-block", "all-linear"), ("w_mxfp4_a_mxfp4", "bf16-routed-experts"))
FAST = {("qwen3-moe", "w_mxfp4_a_mxfp4", "experts-only"), ("qwen3-moe", "w_mxfp4_a_mxfp4", "bf16-routed-experts"),
        ("deepseek-v3", "fp8-block", "all-linear")}
# Mean |Δ log-probability| allowed between transformers+Quark and transformers on the dequantized export with
# MXFP4 activation QDQ: the same model code on the same BF16 values (measured 0.0 wherever the weights are the
# same; qwen3.5's block-FP8 export, 13 weights scaled in blocks of 112 rows, gave 0.013 against an FP8 effect of
# 0.017, so the tolerance sits well below both).
TOLERANCE = 0.002


@dataclass(frozen=True)
class Case:
    toy: str
    scheme: str
    recipe: str
    spelling: str = ""  # an export rewritten by tests_engines/cases.py one_spelling (exclude / layer_quant_config)

    @property
    def name(self) -> str:
        return f"{self.toy}-{self.scheme}-{self.recipe}" + (f"-spelling-{self.spelling}" if self.spelling else "")


# Exports as other tools write them (issue #30): exclude in one spelling, from a base whose routed experts are BF16
# (the only Quark exports transformers loads; tests_engines/recipes/spelling-linear.yaml), for every family: the
# spellings of tests_engines/cases.py ONE_SPELLING (Qwen3.5's text-only form is what AutoModelForCausalLM builds).
SPELLING_RECIPE = "spelling-linear"
SPELLINGS = {toy: ONE_SPELLING[toy] for toy in TOYS if toy in ONE_SPELLING}

# Real transformers outcomes the preflight does not predict yet, asserted as recorded so that modelling one fails the
# expectation and the entry goes: toy -> (outcome, the place transformers names (regex), why). None now: Kimi-K2.5's
# kimi_k25 conversion renames every module and Quark matches `exclude` against those names, so the export's
# checkpoint-spelled entries excluded none of them (the recorded miss until the engine rules modelled the renames as
# transformers build_prefixes, with the wqkv split, and the quantizer wrote exclude entries under those names).
TRANSFORMERS_PREFLIGHT_MISSES: dict[str, tuple[str, str, str]] = {}
# Kimi-K2.5 also in the names transformers builds (computed by transformers' own conversion: cases.py
# _transformers_spelling), the form an export made for a transformers runtime carries.
TRANSFORMERS_SPELLINGS = {"kimi-k2.5": ("transformers",), "glm5-next": ("transformers",)}


def cases() -> list[Case]:
    return ([Case(toy, scheme, recipe) for toy in TOYS for scheme, recipe in EXPORTS]
            + [Case(toy, "w_mxfp4_a_mxfp4", SPELLING_RECIPE, s) for toy, spellings in SPELLINGS.items()
               for s in spellings + TRANSFORMERS_SPELLINGS.get(toy, ())])


def materialize(case: Case, root: Path) -> tuple[Path, Path, Path]:
    """(the export, the toy it was quantized from, its dequantized copy)."""
    from quant.dequant import dequantize_checkpoint

    toy = root / f"toy-{case.toy}"
    if not toy.exists():
        build_toy(case.toy, toy, overrides=TIER_OVERRIDES.get(case.toy, {}))
    if case.spelling:
        intact, _, reference = materialize(Case(case.toy, case.scheme, case.recipe), root)
        out = root / case.name
        if not out.exists():
            one_spelling(intact, out, case.toy, case.spelling)
        return out, toy, reference
    out = root / case.name
    if not out.exists():
        recipe = RECIPES / f"{case.recipe}.yaml"
        quantize_checkpoint(toy, out, scheme=case.scheme, recipe=str(recipe) if recipe.exists() else case.recipe,
                            check_engines=None, log=lambda m: None)
    reference = root / (case.name + "-dequantized")
    if not reference.exists():
        dequantize_checkpoint(out, reference)
    return out, toy, reference


def prediction(path: Path) -> list:
    """The preflight's errors for transformers 5.23."""
    return [f for f in verify_checkpoint(path, engines=[RELEASE]).errors if f.engine in ("transformers", "all")]


def run(path: Path, prompts: list[list[int]], timeout: int = 600) -> dict:
    """The probe's outcome line; the tier's venv missing or broken is an error, never a pass."""
    python = QUARK_VENV / "bin" / "python"
    if not python.exists():
        raise RuntimeError(f"{python} not found: `make {QUARK_VENV}/.installed` (part of make test-engines) builds it")
    proc = run_probe(str(python), PROBE, [str(path), json.dumps(prompts)],
                     {**os.environ, "TOKENIZERS_PARALLELISM": "false"}, timeout)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"transformers probe exited {proc.returncode}: {proc.stderr[-2000:]}")
    result = json.loads(lines[-1])
    if result["outcome"] == "setup-error":
        raise RuntimeError(result["error"])
    return result


def tier_reference_logprobs(path: Path, prompts: list[list[int]], qdq_inputs=frozenset(), timeout: int = 600) -> list:
    """transformers_logprobs computed by the tier's own transformers (tests_engines/reference_probe.py in
    .venv-quark), so the reference runs the same model code as the engine side."""
    python = QUARK_VENV / "bin" / "python"
    proc = run_probe(str(python), REFERENCE_PROBE, [str(path), json.dumps(prompts), json.dumps(sorted(qdq_inputs))],
                     {**os.environ, "TOKENIZERS_PARALLELISM": "false"}, timeout)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"transformers reference for {path} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(lines[-1])["logprobs"]


def judge(case: Case, result: dict, reference_logprobs, bf16_logprobs) -> dict:
    """The engine's outcome (loaded / load-error / loads-wrong / forward-error), with, for a model that loaded,
    the log-probability difference from the dequantized export (W4A4 reference) and the quantization effect (the
    reference against the unquantized toy). A model that loaded with values off the reference loads wrong."""
    verdict = {"outcome": result["outcome"], "error": result.get("error", ""), "where": result.get("where", "")}
    if "logprobs" in result:
        verdict["delta"] = mean_abs_diff(result["logprobs"], reference_logprobs)
        verdict["effect"] = mean_abs_diff(reference_logprobs, bf16_logprobs)
        if verdict["outcome"] == "loaded" and verdict["delta"] > TOLERANCE:
            verdict["outcome"] = "loads-wrong"
            verdict["error"] = (f"log-probabilities {verdict['delta']:.4f} from the dequantized export "
                                f"(tolerance {TOLERANCE})")
    return verdict


_BUILT = re.compile(r" builds (\S+) (?:as|and)")
_PARAM = re.compile(r"\.(?:weight|bias|input|output)(?:_quantizer)?(?:\.\w+)?$")  # x.weight_quantizer.scale -> x


def agrees(verdict: dict, findings: list) -> str | None:
    """None when the preflight's prediction matches the engine's outcome (and names the place it fails), else why
    not."""
    if verdict["outcome"] == "loaded":
        return None if not findings else f"loaded, but the preflight predicts: {findings[0].message[:200]}"
    if not findings:
        return f"{verdict['outcome']} ({verdict['error']}), but the preflight predicts a pass"
    where = verdict.get("where")
    # the checkpoint tensors, and the modules the preflight says transformers builds from them (Kimi-K2.5's
    # conversion renames every module: vision_tower.encoder.blocks.0.wqkv is built as model.vision_tower.layers.0.*)
    named = [f.tensor for f in findings] + [m.group(1) for f in findings if (m := _BUILT.search(f.message))]
    # the module itself (a vision tower's: model.visual.blocks.0.mlp.down_proj, which has no decoder-layer place),
    # else its decoder layer and block
    module = _PARAM.sub("", where or "")
    if where and module not in {n.removesuffix(".weight") for n in named} and not same_place(where, named):
        return f"transformers fails on {where}; the preflight names {named[:3]}"
    return None


def reference_qdq(export: Path) -> set[str]:
    """The linears transformers+Quark runs with MXFP4 activations: every W4A4 linear it quantizes."""
    return activation_quantized_linears(export)
