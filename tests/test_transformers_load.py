"""Strict loads with real transformers: every toy, and the dequantized form of every export kind, loads with no
missing, unexpected or mismatched keys beyond the MTP keys transformers itself declares ignored.

transformers never builds MTP heads; its classes silence them with `_keys_to_ignore_on_load_unexpected`, which
names the release's MTP layer index (`model\\.layers\\.78.*` for GLM-5, `^mtp.*` for Qwen3.5). A toy has fewer
layers, so its MTP layer index differs: the test accepts exactly the declared MTP layers' keys, and only for a
class that declares such a pattern.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers

from quant.checkpoint import open_checkpoint, text_config
from quant.dequant import dequantize_checkpoint
from quant.pipeline import quantize_checkpoint
from quant.toy import TOY_NAMES, build_toy, toy_family

pytestmark = pytest.mark.xdist_group("toy")

EXPORTS = [("w_mxfp4_a_mxfp4", "experts-only"), ("w_mxfp4_a_mxfp4", "all-linear"), ("fp8-block", "all-linear")]


def strict_load(path: Path) -> dict:
    """Load with the checkpoint's own architecture class; return the keys transformers complained about
    that it does not declare ignored."""
    config = open_checkpoint(path).config
    # A release's own class name transformers spells otherwise (Kimi-K2.5's remote-code
    # KimiK25ForConditionalGeneration, transformers' Kimi_K25ForConditionalGeneration): the auto class its
    # model_type maps to.
    cls = getattr(transformers, config["architectures"][0], None) or transformers.AutoModelForImageTextToText
    model, info = cls.from_pretrained(path, output_loading_info=True, dtype=torch.bfloat16)
    declared = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    text = text_config(config)
    n = int(text["num_hidden_layers"])
    mtp_layers = range(n, n + int(text.get("num_nextn_predict_layers") or 0))
    # model.layers.N, or the wrapper's model.language_model.layers.N (GLM-5.3-Flash)
    toy_mtp = re.compile(rf"^model\.(?:language_model\.)?layers\.({'|'.join(map(str, mtp_layers))})\.") \
        if len(mtp_layers) else None

    def ignored(key: str) -> bool:
        if any(p.search(key) for p in declared):
            return True
        # The class declares its release's MTP layer ignored; the toy's MTP layer sits at its own index.
        return bool(declared and toy_mtp and toy_mtp.search(key))

    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert torch.isfinite(logits.float()).all()
    return {"missing": list(info["missing_keys"]),
            "unexpected": [k for k in info["unexpected_keys"] if not ignored(k)],
            "mismatched": [k for k, *_ in info["mismatched_keys"]]}


# Toys of families transformers has no class for (toys.yaml `layout`: Kimi-K3) cannot load here; tests/test_toy.py
# asserts that transformers still lacks each one, and the SGLang tier loads them.
# Nor can a toy written as a release transformers has no config class for (DeepSeek-V4.1: `release_extras`), nor a
# toy stored in a format transformers does not read (MiniMax-M3.1-Flash's ModelOpt NVFP4 experts: tests/test_toy.py
# reloads its decoded copy, and its dequantized exports load strictly here).
TRANSFORMERS_TOYS = tuple(name for name in TOY_NAMES
                          if toy_family(name).config_class and not toy_family(name).release_extras)
STRICT_TOYS = tuple(name for name in TRANSFORMERS_TOYS if not toy_family(name).release_format)


@pytest.fixture(scope="module")
def toys(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("toys")
    return {name: build_toy(name, root / name) for name in TRANSFORMERS_TOYS}


@pytest.mark.parametrize("name", STRICT_TOYS)
def test_every_toy_loads_strictly(toys, name):
    assert strict_load(toys[name]) == {"missing": [], "unexpected": [], "mismatched": []}


@pytest.mark.parametrize("scheme,recipe", EXPORTS)
@pytest.mark.parametrize("name", TRANSFORMERS_TOYS)
def test_every_dequantized_export_loads_strictly(toys, tmp_path, name, scheme, recipe):
    export = tmp_path / "q"
    quantize_checkpoint(toys[name], export, scheme=scheme, recipe=recipe, check_engines=None, log=lambda m: None)
    plain = dequantize_checkpoint(export, tmp_path / "plain")
    assert strict_load(plain) == {"missing": [], "unexpected": [], "mismatched": []}


def test_a_dropped_tensor_is_reported_missing(toys, tmp_path):
    """The check can fail: a toy without one routed expert's weight is reported, not silently loaded."""
    from safetensors.torch import load_file, save_file
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(toys["qwen3-moe"], broken)
    tensors = load_file(broken / "model.safetensors")
    victim = "model.layers.1.self_attn.o_proj.weight"
    del tensors[victim]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    assert strict_load(broken)["missing"] == [victim]
