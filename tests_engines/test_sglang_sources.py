"""Exports of microscaled sources in real SGLang (issue #31), run with .venv-sglang's interpreter like test_sglang.py:
the qwen3-moe tier toy (cases.TIER_OVERRIDES) stored as each release format stores it (`quant toy --source-format`:
Kimi-K3's compressed-tensors MXFP4, MiniMax-M3's MXFP8, compressed-tensors NVFP4), quantized by `quant quantize`
(the compressed-tensors MXFP4 experts carried over bit for bit, the others decoded once). SGLang 0.5.12 and 0.5.23
build the model with their own loaders (tests_engines/sglang_probe.py); the preflight predicts a load, SGLang loads,
and every weight it holds decodes (MXFP4 by SGLang 0.5.23's own `_dequant_mxfp4_to_bf16`) to quant.dequant's reading
of the export, which for the carried-over experts is compressed-tensors' own values (tests/test_source_formats.py).

    .venv-sglang/bin/python -m pytest -q -rA -p no:cacheprovider tests_engines/test_sglang_sources.py
"""

from __future__ import annotations

import json

import pytest

from tests_engines.cases import (SGLANG_RELEASES, TIER_OVERRIDES, decoded_kinds, quantized_kinds, run_sglang,
                                 sglang_outcome, sglang_prediction)

TOY = "qwen3-moe"
CASES = [("ct-mxfp4", "passthrough"), ("mxfp8", "quantize"), ("ct-nvfp4", "quantize")]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("sglang-sources")


def _export(work, fmt):
    from quant.dequant import dequantize_checkpoint
    from quant.pipeline import quantize_checkpoint
    from quant.toy import build_toy

    toy, out, reference = work / f"toy-{fmt}", work / f"{fmt}-export", work / f"{fmt}-dequantized"
    if not out.exists():
        build_toy(TOY, toy, overrides=TIER_OVERRIDES[TOY], source_format=fmt)
        quantize_checkpoint(toy, out, check_engines=None, log=lambda m: None)  # w_mxfp4_a_mxfp4, experts-only
        dequantize_checkpoint(out, reference)
    return out, reference


@pytest.mark.parametrize("release", sorted(SGLANG_RELEASES))
@pytest.mark.parametrize("fmt,experts", CASES, ids=[c[0] for c in CASES])
def test_sglang_loads_the_export_of_a_microscaled_source(work, fmt, experts, release):
    path, reference = _export(work, fmt)
    manifest = json.loads((path / "quant_manifest.json").read_text())
    assert {r["action"] for r in manifest["tensors"].values() if r.get("role") == "routed_experts"} == {experts}
    assert sglang_prediction(path, release) == []
    result = run_sglang(release, path, reference)
    assert sglang_outcome(result) == "pass", result
    model = result["models"]["main"]
    assert model["checked"] > 0
    bad = {k: v for k, v in model.get("decoded", {}).items() if "error" in v or v["diff"] != 0.0}
    assert not bad, f"SGLang's quantized weights decode differently from quant.dequant: {bad}"
    missing = quantized_kinds(path, "main") - set(decoded_kinds(model))
    assert not missing, missing
    if release != "0.5.12":
        assert result["mxfp4_decoder"] == "sglang:_dequant_mxfp4_to_bf16", result["mxfp4_decoder"]
