"""engine rules' vLLM name mappers against the installed vLLM's own (issue #42 item 2): for the wrappers vLLM registers
but its CPU tier cannot build (GLM-5.3-Flash, Qwen4-Exp, Kimi-K3), the names engine rules give every tensor of the toy
are the names the class's hf_to_vllm_mapper gives it in the form QuarkConfig.apply_vllm_mapper receives it
(get_rename_mapper(): model_loader/utils.py configure_quant_config, models/interfaces.py SupportsQuant). The classes are
imported in a subprocess with the inert torchvision (stubs/torchvision: the Qwen-VL and GLM-4V processors import it at
module level); nothing is built. GLM-5.3-Flash's MTP draft (Glm5NextMTP) is built with its decoder layer stubbed out: the
names it gives the MTP layer's modules, the ones its loader gives their weights and what the target's mapper makes of
the exclude entries the quantizer writes for them.

    .venv-engines/bin/python -m pytest -q -rA tests_engines/test_vllm_mappers.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests_engines.cases import STUBS

vllm = pytest.importorskip("vllm")

CLASSES = {"glm5-next": ("vllm.models.glm5next", "Glm5NextForConditionalGeneration"),
           "qwen4-exp": ("vllm.models.qwen4_exp", "Qwen4ExpForConditionalGeneration"),
           "kimi-k3": ("vllm.models.kimi_k3", "KimiK3ForConditionalGeneration")}

_MAP = """
import importlib, json, sys
module, cls, names = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
mapper = getattr(importlib.import_module(module), cls).hf_to_vllm_mapper
rename = mapper.get_rename_mapper()
print(json.dumps({"rename": {n: rename._map_name(n) for n in names}, "load": {n: mapper._map_name(n) for n in names}}))
"""


def _release() -> str:
    return ".".join(vllm.__version__.split(".")[:2])


def _vllm_names(toy: str, names: list[str]) -> dict:
    module, cls = CLASSES[toy]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(STUBS), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", _MAP, module, cls, json.dumps(names)], capture_output=True,
                          text=True, env=env, timeout=600)
    if proc.returncode != 0:
        pytest.skip(f"vLLM {vllm.__version__} cannot import {cls} here: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("toy", list(CLASSES))
def test_engines_yaml_names_every_toy_tensor_as_the_installed_vllm(toy, tmp_path):
    from quant.engines import profile, releases
    from quant.safetensors_header import read_header
    from quant.toy import build_toy

    if _release() not in releases("vllm"):
        pytest.skip(f"no engine profile for vLLM {vllm.__version__}")
    ckpt = build_toy(toy, tmp_path / "toy", seed=0)
    config = json.loads((ckpt / "config.json").read_text())
    names = sorted(k for shard in ckpt.glob("*.safetensors") for k in read_header(shard)[0] if k != "__metadata__")
    mapped = _vllm_names(toy, names)
    renamer = profile("vllm", _release()).renamer(config)

    def ours(tensor: str) -> str:
        module, _, suffix = tensor.rpartition(".")
        return f"{renamer.name(module)}.{suffix}"

    assert {n: ours(n) for n in names} == mapped["rename"]
    # Weight loading uses the full mapper, which only drops (None) what the quant-config form keeps as written.
    assert all(mapped["load"][n] in (None, mapped["rename"][n]) for n in names)
    assert any(mapped["rename"][n] != n for n in names)  # the toy has names the mapper renames


# Glm5NextMTP as vLLM builds it for a GLM-5.3-Flash target (config/speculative.py: model_type glm5_next -> Glm5NextMTPModel):
# the real Glm5NextMTP / Glm5NextMultiTokenPredictor / Glm5NextMultiTokenPredictorLayer, with the decoder layer, norms,
# shared head, embedding and logits processor replaced by stubs that record the prefix they are handed (the decoder
# layer builds its modules at f"{prefix}.self_attn" / f"{prefix}.mlp", model.py). The loader's renames are its own
# code: the model.language_model. strip in load_weights (read from its source), get_spec_layer_idx_from_weight_name and
# _rewrite_spec_layer_name. The target's mapper is Glm5NextForConditionalGeneration's get_rename_mapper(), the one
# QuarkConfig.apply_vllm_mapper applies to the exclude list the draft shares.
_DRAFT = """
import importlib, inspect, json, sys, types
import torch.nn as nn
names, entries, text = json.loads(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
mtp = importlib.import_module("vllm.models.glm5next.common.mtp")
built = {}

class Layer(nn.Module):
    def __init__(self, *, prefix, layer_idx, **kw):
        super().__init__()
        built[layer_idx] = prefix
        self.self_attn = mtp.Glm5NextMLAAttention.__new__(mtp.Glm5NextMLAAttention)
        nn.Module.__init__(self.self_attn)
        self.self_attn.mla_attn = None

class Stub(nn.Module):
    def __init__(self, *a, **kw):
        super().__init__()

mtp.Glm5NextDecoderLayer = Layer
for stub in ("RMSNorm", "SharedHead", "VocabParallelEmbedding", "LogitsProcessor"):
    setattr(mtp, stub, type(stub, (Stub,), {}))
mtp.Glm5NextMTP.set_moe_parameters = lambda self: None
mtp.is_model_fused_shared_expert_compatible = lambda *a, **k: False
cfg = types.SimpleNamespace(**text)
vllm_config = types.SimpleNamespace(
    model_config=types.SimpleNamespace(hf_text_config=cfg), quant_config=None,
    speculative_config=types.SimpleNamespace(draft_model_config=types.SimpleNamespace(hf_text_config=cfg)),
    scheduler_config=types.SimpleNamespace(max_num_batched_tokens=8))
draft = mtp.Glm5NextMTP(vllm_config=vllm_config, prefix="")
strip = 'name.replace("model.language_model.", "model.", 1)' in inspect.getsource(mtp.Glm5NextMTP.load_weights)
loaded = {}
for name in names:
    if strip and name.startswith("model.language_model."):
        name_ = name.replace("model.language_model.", "model.", 1)
    else:
        name_ = name
    layer = mtp.get_spec_layer_idx_from_weight_name(cfg, name_)
    loaded[name] = None if layer is None else mtp.Glm5NextMTP._rewrite_spec_layer_name(draft, layer, name_)
target = importlib.import_module("vllm.models.glm5next").Glm5NextForConditionalGeneration
rename = target.hf_to_vllm_mapper.get_rename_mapper()
print(json.dumps({"layers": {str(k): v for k, v in built.items()},
                  "modules": [n for n, _ in draft.named_modules()], "loaded": loaded,
                  "exclude": {e: rename._map_name(e) for e in entries}}))
"""


def test_glm5_next_draft_names_as_the_installed_vllm(tmp_path):
    """The MTP layer's modules are built, and looked up in the quant config, at model.layers.{N}.* (engine rules vllm
    mtp.draft_names), their weights land there, the target's mapper rewrites the checkpoint-named exclude entry away
    from that name and leaves the one the quantizer writes for the draft (exclude_aliases) matching it."""
    from quant.engines import exclude_aliases, mtp_layers, profile, releases
    from quant.families import text_config
    from quant.safetensors_header import read_header
    from quant.toy import build_toy

    if _release() not in releases("vllm"):
        pytest.skip(f"no engine profile for vLLM {vllm.__version__}")
    ckpt = build_toy("glm5-next", tmp_path / "toy", seed=0)
    config = json.loads((ckpt / "config.json").read_text())
    text = text_config(config)
    first = mtp_layers(config).start
    layer = f"model.language_model.layers.{first}."
    names = sorted(k for shard in ckpt.glob("*.safetensors") for k in read_header(shard)[0] if k.startswith(layer))
    modules = sorted({n.rpartition(".")[0] for n in names})
    entries = sorted({e for m in modules for e in exclude_aliases(m, config)})
    keys = ("num_hidden_layers", "num_nextn_predict_layers", "index_topk", "index_kpool", "hidden_size",
            "rms_norm_eps", "vocab_size")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(STUBS), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", _DRAFT, json.dumps(names), json.dumps(entries),
                           json.dumps({k: text[k] for k in keys})], capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        pytest.skip(f"vLLM {vllm.__version__} cannot import Glm5NextMTP here: {proc.stderr.strip().splitlines()[-1:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    block = got["layers"][str(first)]
    assert block == f"model.layers.{first}"  # the decoder layer's prefix: its modules are block.<sub>
    assert f"model.layers.{first}.eh_proj" in got["modules"]  # the predictor layer's own modules, under the same
    p = profile("vllm", _release())
    for name in names:
        module, _, param = name.rpartition(".")
        sub = module[len(layer):]
        built = f"{block}.{sub}"  # the name the draft's quant config looks the module up by
        assert p.mtp_draft_name(module, config) == built
        # its weight lands in that module (the decoder block is mtp_block, built with the layer's prefix)
        assert got["loaded"][name] in (f"{block}.mtp_block.{sub}.{param}", f"{built}.{param}"), name
    for module in modules:
        built = p.mtp_draft_name(module, config)
        written = exclude_aliases(module, config)
        assert got["exclude"][module] != built  # the checkpoint-named entry misses the draft ...
        assert any(got["exclude"][e] == built for e in written), written  # ... the written spelling matches it
