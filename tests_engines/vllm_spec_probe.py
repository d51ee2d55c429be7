"""Run inside the engine venv: greedy generation with vLLM's own MTP speculative decoding (speculative_config
method "deepseek_mtp"), printing the generated tokens and vLLM's spec-decode counters.

    python tests_engines/vllm_spec_probe.py CHECKPOINT NUM_SPECULATIVE_TOKENS '[[1, 2, 3], ...]' MAX_TOKENS

Prints one JSON line: {"outputs": [[...], ...], "counters": {"vllm:spec_decode_num_drafts": n, ...}}.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> int:
    checkpoint, depth, prompts, max_tokens = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
    from vllm import LLM, SamplingParams

    llm = LLM(model=checkpoint, dtype="bfloat16", max_model_len=256, enforce_eager=True, max_num_seqs=4, seed=0,
              speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": depth},
              disable_log_stats=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    counters = {m.name: getattr(m, "value", None) if hasattr(m, "value") else getattr(m, "values", None)
                for m in llm.get_metrics() if "spec_decode" in m.name}
    print(json.dumps({"outputs": [list(o.outputs[0].token_ids) for o in outputs], "counters": counters}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
