"""The preflight of a source is not an error (issue #50 item 2): `quant verify-manifest` on an unquantized checkpoint
(the Hub workflow's first step) or on a release in a source format quantize reads says what it is, what the engines
load and what `quant quantize` would write from it, and exits 0; a checkpoint whose U8/F8 weights no config declares
still fails."""

from __future__ import annotations

import json

import pytest

from quant.pipeline import quantize_checkpoint
from quant.toy import build_toy
from quant.verify import verify_checkpoint

SOURCES = {  # toy, source format -> kind
    ("qwen3-moe", None): "unquantized",
    ("qwen4-exp", None): "unquantized",          # BF16 weights beside I64 buffers
    ("kimi-k3", None): "microscaled",            # compressed-tensors MXFP4
    ("deepseek-v4", None): "microscaled",        # native MXFP4 + UE8M0 FP8 under quant_method fp8
    ("minimax-m3", "mxfp8"): "microscaled",
    ("qwen3-moe", "modelopt-nvfp4"): "microscaled",
    ("minimax-m3.1-flash", None): "microscaled",
}


@pytest.mark.parametrize("toy,fmt", sorted(SOURCES, key=str))
def test_a_source_is_described_and_passes(tmp_path, toy, fmt):
    src = build_toy(toy, tmp_path / "src", source_format=fmt)
    report = verify_checkpoint(src)
    assert report.exit_code == 0, [f.message for f in report.errors]
    assert report.source is not None and report.source.kind == SOURCES[toy, fmt]
    # What it says quantize would do is what quantize does.
    summary = quantize_checkpoint(src, tmp_path / "out", check_engines=[], log=lambda *a: None)["summary"]
    quantized = sum(n for k, n in summary["modules_by_treatment"].items() if k.startswith("w_"))
    assert f"would quantize {quantized} linear(s)" in report.source.would, report.source.would
    assert report.to_json()["source"]["kind"] == SOURCES[toy, fmt]


def test_an_export_is_not_described_as_a_source(toy_factory, tmp_path):
    out = tmp_path / "out"
    quantize_checkpoint(toy_factory("qwen3-moe"), out, log=lambda *a: None)
    assert verify_checkpoint(out).source is None
    assert verify_checkpoint(toy_factory("qwen3-moe", fp8_block=True)).source is None  # the block-FP8 checks judge it


def test_quantized_weights_without_a_config_still_fail(toy_factory, tmp_path):
    out = tmp_path / "out"
    quantize_checkpoint(toy_factory("qwen3-moe"), out, log=lambda *a: None)
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    report = verify_checkpoint(out)
    assert report.exit_code == 1 and report.source is None
    assert any("has no quantization_config" in f.message for f in report.errors)


def test_the_cli_prints_what_the_source_is(toy_factory, tmp_path):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "quant", "verify-manifest", str(toy_factory("glm5"))],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "an unquantized checkpoint (BF16" in run.stdout and "quant quantize (default scheme" in run.stdout
