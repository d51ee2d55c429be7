"""Run inside the engine venv (`make test-engines`): build one checkpoint with vLLM's own config parsing, model
construction and weight loaders, then score fixed prompts teacher-forced.

    python tests_engines/vllm_probe.py CHECKPOINT '[[1, 2, 3], ...]'

Prints one JSON line: {"outcome": "loaded", "logprobs": [[...], ...]} (the log-probability vLLM gives each
prompt token after the first), {"outcome": "load-error", "error": "<exception type>: <first line>", "where": ...}
when building the model or loading its weights raises, {"outcome": "run-error", ...} when the loaded model's forward
raises, or {"outcome": "setup-error", ...} when vLLM or the shim cannot be imported or installed (the tier raises on
that: an environment failure is never an outcome under test).

vLLM itself is not patched; vllm_emulation.py is the one test-only shim (what it replaces is in its docstring),
and the outcome line lists the layer kinds it routed to emulation ("emulated"). QUANT_VLLM_EMULATION=force routes
them even on a CPU whose ISA has vLLM's native kernels.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

# One process, no engine-core subprocess: the probe is itself a subprocess of the test.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _text_only(checkpoint: str) -> dict:
    """A vision-language class (Qwen3.5) runs as vLLM's --language-model-only: the tier sends token ids, and the
    toy, like the test prompts, has no image preprocessor config. The text model is built and loaded in full."""
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    return {"language_model_only": True} if "vision_config" in config else {}


def _failing_name(tb) -> str | None:
    """What vLLM was loading or building when it raised, read from the traceback's own locals: the innermost
    `load_weights` frame's tensor `name` under the innermost `_load_module` prefix of vLLM's AutoWeightsLoader
    (e.g. layers.1.mlp.experts + w13_weight_scale), else the module prefix of the innermost constructor. The tier
    matches it against the tensors the preflight names."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next

    def innermost(function: str, key: str) -> str | None:
        for frame in reversed(frames):
            value = frame.f_locals.get(key)
            if frame.f_code.co_name == function and isinstance(value, str) and value:
                return value
        return None

    name, module = innermost("load_weights", "name"), innermost("_load_module", "prefix")
    if name and "layers." in name:
        return name
    if module and "layers." in module:
        return f"{module}.{name}" if name else module
    built = innermost("__init__", "prefix")
    return built if built and "layers." in built else None


def _error(e: BaseException) -> str:
    message = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {message}"[:400]


def _raised_at(tb) -> str:
    """"<path from the package root>:<line>" of the innermost frame (vllm/.../cpu_router.py:239)."""
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return ""
    path = tb.tb_frame.f_code.co_filename
    for root in ("/site-packages/", "/tests_engines/"):
        if root in path:
            path = path.split(root, 1)[1]
    return f"{path}:{tb.tb_lineno}"


def preload() -> None:
    """What the zygote (zygote.py) imports once before forking a child per checkpoint: vLLM, the shim, and the
    amd-quark MX module vLLM's MXFP4 path imports."""
    from vllm import LLM, SamplingParams  # noqa: F401
    from quark.torch.kernel import mx  # noqa: F401

    import vllm_emulation  # noqa: F401


def main() -> int:
    checkpoint, prompts = sys.argv[1], json.loads(sys.argv[2])
    try:  # the engine and the shim: a failure here is the tier's environment, never an outcome under test
        from vllm import LLM, SamplingParams

        import vllm_emulation  # beside this script

        vllm_emulation.install()
        config = json.loads((Path(checkpoint) / "config.json").read_text())
        index_topk = config.get("index_topk", config.get("text_config", {}).get("index_topk"))
        if index_topk is not None:
            vllm_emulation.install_dense_dsa(index_topk, max(len(ids) for ids in prompts))
    except BaseException as e:  # noqa: BLE001 - reported, and the tier raises on it
        traceback.print_exc()
        print(json.dumps({"outcome": "setup-error", "error": _error(e)}))
        return 0
    try:
        llm = LLM(model=checkpoint, dtype="bfloat16", max_model_len=256, enforce_eager=True, max_num_seqs=4,
                  gpu_memory_utilization=0.1, seed=0, **_text_only(checkpoint))
    except Exception as e:  # the outcome under test: vLLM refused the checkpoint
        traceback.print_exc()  # on stderr, for the one reading a failing tier; the outcome line is on stdout
        print(json.dumps({"outcome": "load-error", "error": _error(e), "where": _failing_name(e.__traceback__),
                          "at": _raised_at(e.__traceback__)}))
        return 0
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    try:
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    except Exception as e:  # built and loaded, but its forward raised (e.g. a router vLLM-CPU cannot run)
        traceback.print_exc()
        print(json.dumps({"outcome": "run-error", "error": _error(e), "where": _failing_name(e.__traceback__),
                          "at": _raised_at(e.__traceback__), "emulated": sorted(vllm_emulation.EMULATED)}))
        return 0
    logprobs = []
    for ids, out in zip(prompts, outputs):
        row = []
        for token, entry in zip(ids[1:], out.prompt_logprobs[1:]):
            row.append(entry[token].logprob)
        logprobs.append(row)
    print(json.dumps({"outcome": "loaded", "logprobs": logprobs, "emulated": sorted(vllm_emulation.EMULATED)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
