"""Run by tests_engines/test_sglang_minimax_dspark.py with .venv-sglang's interpreter: SGLang 0.5.23 builds
MiniMax-M3.1's DSpark draft (DSparkMiniMaxDraftModel) from a checkpoint's own config.json and loads it through its own
weight-file selection and load_weights, on CPU (no forward).

    python tests_engines/sglang_dspark_probe.py CHECKPOINT

Prints one JSON line: {"bundles": bool (checkpoint_bundles_dspark_draft of the target config), "files": the
*.safetensors SGLang's DefaultModelLoader selects, "outcome": "loaded" | "build-error" | "load-error", "error",
"params": {name: [shape, dtype]}, "quant_methods": {linear: its quant method class}, "mismatched": parameters whose
values differ from the draft file's (q/k/v and gate/up concatenated as SGLang stacks them), "unwritten": ...}.

The path SGLang itself takes (configs/model_config.py:1020-1030 `_config_draft_model`) switches to the draft class
only when the draft config's architectures[0] is DSparkMiniMaxDraftModel, which a target config.json is not; this
probe therefore calls what that branch calls, configure_minimax_m3_dspark (configs/minimax_vl.py:64-110), on the
target's config, builds the class with the quant config SGLang derives from the target's quantization_config (the
one configure_minimax_m3_dspark hands the draft, :110), and feeds load_weights SGLang's own weight iterator over the
checkpoint directory (DefaultModelLoader._get_all_weights: the index's files, weight_utils.py:757-808).
The shim is the SGLang tier's (sglang_probe.install_shim; nothing else is patched)."""

from __future__ import annotations

import json
import os
import sys
import traceback

from tests_engines.sglang_probe import _first_line, init_distributed, install_shim

DRAFT_PREFIX = "language_model.model.dspark."
# SGLang stacks these checkpoint tensors into one parameter (dspark_minimax.py:278-284), in this order.
STACKED = {".qkv_proj.": (".q_proj.", ".k_proj.", ".v_proj."), ".gate_up_proj.": (".gate_proj.", ".up_proj.")}


def _file_value(draft: dict, name: str):
    """The value the draft file means for SGLang parameter `name` (None: the file has no source for it)."""
    import torch

    for fused, parts in STACKED.items():
        if fused in name:
            pieces = [draft.get(DRAFT_PREFIX + name.replace(fused, p)) for p in parts]
            return None if any(p is None for p in pieces) else torch.cat(pieces)
    return draft.get(DRAFT_PREFIX + name)


def _compare(model, draft: dict) -> tuple[list, list]:
    mismatched, unwritten = [], []
    for name, param in model.named_parameters():
        value = _file_value(draft, name)
        if value is None:
            unwritten.append(name)
        elif tuple(value.shape) != tuple(param.shape) or not bool((value.to(param.dtype) == param.data).all()):
            mismatched.append(name)
    return mismatched, unwritten


def main() -> int:
    path = sys.argv[1]
    install_shim()
    import torch
    from safetensors.torch import load_file

    import sglang.srt.model_loader.loader as L
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.minimax_vl import configure_minimax_m3_dspark
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.models.dspark_minimax import DSparkMiniMaxDraftModel
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.dspark_components.dspark_config import checkpoint_bundles_dspark_draft

    server_args = ServerArgs(model_path=path, device="cuda", tp_size=1, dtype="bfloat16", disable_radix_cache=True,
                             trust_remote_code=False)
    init_distributed(server_args, (0, 5, 23))
    model_config = ModelConfig.from_server_args(server_args, model_path=path)
    load_config = LoadConfig(load_format="auto")
    loader = L.DefaultModelLoader(load_config)
    files = loader._prepare_weights(path, None, True)[1]
    result = {"bundles": checkpoint_bundles_dspark_draft(model_config.hf_config),
              "files": sorted(os.path.basename(f) for f in files)}
    try:
        text = configure_minimax_m3_dspark(model_config.hf_config)
        quant_config = L._get_quantization_config(model_config, load_config)
        with L.set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
            model = DSparkMiniMaxDraftModel(text, quant_config=quant_config)
    except Exception as e:
        print(json.dumps({**result, "outcome": "build-error", "error": _first_line(e),
                          "trace": traceback.format_exc()[-3000:]}))
        return 0
    result["params"] = {n: [list(p.shape), str(p.dtype)] for n, p in model.named_parameters()}
    result["quant_methods"] = {n: type(m.quant_method).__name__ for n, m in model.named_modules()
                               if getattr(m, "quant_method", None) is not None}
    try:
        with L.set_default_torch_dtype(torch.bfloat16):
            model.load_weights(loader._get_all_weights(model_config, model))
    except Exception as e:
        print(json.dumps({**result, "outcome": "load-error", "error": _first_line(e),
                          "trace": traceback.format_exc()[-3000:]}))
        return 0
    draft_file = os.path.join(path, "dspark.safetensors")
    draft = load_file(draft_file) if os.path.exists(draft_file) else {}
    result["mismatched"], result["unwritten"] = _compare(model, draft)
    print(json.dumps({**result, "outcome": "loaded"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
