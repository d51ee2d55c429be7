"""engines.yaml's vLLM name mappers against the installed vLLM's own (issue #42 item 2): for the wrappers vLLM registers
but its CPU tier cannot build (GLM-5.3-Flash, Qwen4-Exp, Kimi-K3), the names engines.yaml gives every tensor of the toy
are the names the class's hf_to_vllm_mapper gives it in the form QuarkConfig.apply_vllm_mapper receives it
(get_rename_mapper(): model_loader/utils.py configure_quant_config, models/interfaces.py SupportsQuant). The classes are
imported in a subprocess with the inert torchvision (stubs/torchvision: the Qwen-VL and GLM-4V processors import it at
module level); nothing is built.

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
# engines.yaml has no vLLM mapper for GLM-5.3-Flash (its MTP draft's names are not modelled; see the comment there and
# tests/test_vllm_registered_names.py).
UNMODELLED = {"glm5-next"}

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


@pytest.mark.parametrize("toy", [pytest.param(t, marks=pytest.mark.xfail(
    strict=True, reason="engines.yaml gives GLM-5.3-Flash no vLLM mapper")) if t in UNMODELLED else t
    for t in CLASSES])
def test_engines_yaml_names_every_toy_tensor_as_the_installed_vllm(toy, tmp_path):
    from quant.engines import profile, releases
    from quant.safetensors_header import read_header
    from quant.toy import build_toy

    if _release() not in releases("vllm"):
        pytest.skip(f"no engines.yaml profile for vLLM {vllm.__version__}")
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
