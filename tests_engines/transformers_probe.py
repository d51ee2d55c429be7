"""Load one checkpoint with transformers' own quantization integrations and score prompts; prints one JSON line.

Runs in the transformers tier's venv (.venv-quark: transformers 5.23 + amd-quark 0.13 + accelerate, no moe-quant
installed), so nothing of ours is on either side of the comparison:
- a Quark export (`quant_method: "quark"`) goes through transformers' QuarkHfQuantizer: amd-quark's `_map_to_quark`
  replaces every nn.Linear that is not excluded by a QParamsLinear, the checkpoint's `weight_scale`/`input_scale`
  are renamed into its quantizers, and the forward runs Quark's own (CPU) MX/FP8 emulation;
- a block-FP8 export (`quant_method: "fp8"`) goes through FineGrainedFP8HfQuantizer, which without a GPU
  dequantizes the weights to BF16 while loading (Fp8Dequantize).
Nothing is patched. Outcomes: "loaded" (with teacher-forced log-probabilities of the prompts), "load-error"
(`from_pretrained` raised), "loads-wrong" (it returned a model but reported checkpoint tensors it did not use, or
parameters it did not load), "forward-error" (loaded, then the forward raised).

    python transformers_probe.py CHECKPOINT PROMPTS_JSON
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import sys


def _auto_class(transformers, path: str):
    """AutoModelForCausalLM, as a user loads a language model (Qwen3.5's VL checkpoint builds its text model); a
    wrapper that class has no model for (Kimi-K2.5's kimi_k25) loads as what transformers maps it to,
    AutoModelForImageTextToText."""
    model_type = json.loads(open(f"{path}/config.json").read()).get("model_type")
    causal = transformers.AutoModelForCausalLM
    if model_type in causal._model_mapping._model_mapping:
        return causal
    return transformers.AutoModelForImageTextToText


_BRACES = re.compile(r"\{([^,}]+)[^}]*\}")
_LAYER = re.compile(r"layers\.(\d+)\.")


def _first_name(line: str) -> str:
    """The first tensor a line of transformers' load report names ("model.layers.{0, 1}.mlp..." -> layer 0)."""
    if "destined for " in line:
        line = line.split("destined for ", 1)[1]
    line = _BRACES.sub(r"\1", line.split("|", 1)[0]).strip()
    return line.split()[0].rstrip(".") if line else ""


def _mtp_layer(key: str, layers: int) -> bool:
    """A key of an MTP/NextN layer (model.layers.{N >= num_hidden_layers}), which transformers never builds."""
    hit = _LAYER.search(key)
    return hit is not None and int(hit.group(1)) >= layers


def preload() -> None:
    """What the zygote (zygote.py) imports once before forking a child per checkpoint."""
    import quark.torch  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401


def main() -> int:
    import torch
    import transformers

    from logprobs import teacher_forced  # beside this script (its directory is sys.path[0])

    path, prompts = sys.argv[1], json.loads(sys.argv[2])
    out: dict = {"transformers": transformers.__version__}
    try:
        import quark  # noqa: F401  (transformers' Quark integration imports it lazily; its absence is a setup error)
        from importlib.metadata import version

        out["amd-quark"] = version("amd-quark")
    except ImportError as exc:
        print(json.dumps({"outcome": "setup-error", "error": f"amd-quark does not import: {exc}"}))
        return 0
    log = io.StringIO()
    handler = logging.StreamHandler(log)  # the load report is logged, then raised about
    logging.getLogger("transformers").addHandler(handler)
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            model, info = _auto_class(transformers, path).from_pretrained(path, dtype=torch.bfloat16,
                                                                         output_loading_info=True)
    except Exception as exc:  # the engine's outcome, reported rather than raised
        report = log.getvalue().splitlines()
        conversion = [l for l in report if l.startswith("Error:")]
        rows = [l for l in report if "|" in l and any(k in l for k in ("MISMATCH", "MISSING", "CONVERSION"))]
        out.update(outcome="load-error", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                   report=rows[:20], conversion=conversion[:5],
                   where=_first_name((conversion or rows or [""])[0]))
        if conversion:
            out["error"] += " " + conversion[0][:300]
        elif rows:
            out["error"] += " " + " ".join(rows[0].split())[:300]
        print(json.dumps(out))
        return 0
    logging.getLogger("transformers").removeHandler(handler)
    config = json.loads(open(f"{path}/config.json").read())
    layers = (config.get("text_config") or config)["num_hidden_layers"]
    unused = sorted(k for k in info.get("unexpected_keys") or [] if not _mtp_layer(k, layers))
    missing = sorted(info.get("missing_keys") or [])
    out["modules"] = sorted({type(m).__name__ for m in model.modules()})
    try:
        out["logprobs"] = teacher_forced(model, prompts)
    except Exception as exc:
        out.update(outcome="forward-error", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                   unused=unused[:20], missing=missing[:20])
        print(json.dumps(out))
        return 0
    if unused or missing:
        out.update(outcome="loads-wrong", error=f"{len(unused)} checkpoint tensors unused, {len(missing)} "
                   f"parameters not loaded", unused=unused[:20], missing=missing[:20],
                   where=(unused or missing)[0])
    else:
        out["outcome"] = "loaded"
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
