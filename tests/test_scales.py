"""Scale sanity (`quant verify-manifest --scales`): scale blocks that load everywhere and answer wrongly.

The public incidents (experts calibration or weight loading never reached): an MXFP4 E8M0 scale of all 0x00
(the expert outputs zero) or any 0xFF (NaN), FP8 scales of zero / NaN. The detection is checked on arrays, then
end to end: a real toy export, one expert's scales corrupted in its shard, and the CLI must name that expert
and exit 1; the clean export passes with exit 0.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from quant.verify.scales import (declares_mx, e8m0_matrix_issues, float_matrix_issues, group_issues,
                                 scale_kind, scan_scales, tensor_issues)

EXPERT = "model.layers.1.mlp.experts.3"


# ---- detection on arrays ---------------------------------------------------------------------------------------

def _scales(rows=64, blocks=8, seed=0):
    return np.random.default_rng(seed).integers(110, 130, size=(rows, blocks), dtype=np.uint8)


def test_clean_e8m0_scales_have_no_issue():
    assert e8m0_matrix_issues(_scales(), "w", "w") == []


def test_e8m0_severities():
    whole = np.zeros((64, 8), np.uint8)
    assert [(i.rule, i.severity) for i in e8m0_matrix_issues(whole, "w", "w")] == [("e8m0-zero", "error")]
    nan = _scales()
    nan[5, 2] = 0xFF
    (issue,) = e8m0_matrix_issues(nan, "w", "w")
    assert (issue.rule, issue.severity, issue.counts["bad"]) == ("e8m0-nan", "error", 1)
    half = _scales()
    half[32:] = 0  # the up half of a fused gate_up never loaded
    assert [i.rule for i in e8m0_matrix_issues(half, "w", "w")] == ["e8m0-zero-rows"]
    scattered = _scales()
    scattered[[1, 7, 9], [0, 3, 3]] = 0  # blocks that are all zeros in the source: legitimate, but counted
    (issue,) = e8m0_matrix_issues(scattered, "w", "w")
    assert (issue.rule, issue.severity, issue.counts["bad"], issue.counts["total"]) == \
        ("e8m0-zero-blocks", "warning", 3, 512)


def test_float_scale_issues():
    v = np.full(16, 0.01, np.float32)
    assert float_matrix_issues(v, "w", "w") == []
    v[3], v[4], v[5] = np.nan, np.inf, 0.0
    rules = {i.rule: i for i in float_matrix_issues(v, "w", "w")}
    assert rules["fp-nonfinite"].counts == {"bad": 2, "total": 16, "nan": 1} and rules["fp-nonfinite"].severity == \
        "error"
    assert rules["fp-zero-some"].severity == "warning"
    assert float_matrix_issues(np.zeros(4, np.float32), "w", "w")[0].severity == "error"
    assert float_matrix_issues(np.zeros(1, np.float32), "x", "x", activation=True)[0].rule == "fp-zero-activation"


def test_fused_expert_tensors_are_checked_expert_by_expert():
    fused = np.stack([_scales(seed=e) for e in range(4)])
    fused[2] = 0
    findings = group_issues(tensor_issues("model.layers.0.mlp.experts.gate_up_proj_scales", "e8m0", fused))
    assert [(f.severity, f.tensor) for f in findings] == [("error", "model.layers.0.mlp.experts.2 (gate_up_proj)")]


def test_an_experts_projections_group_into_one_line():
    issues = []
    for proj in ("gate_proj", "up_proj", "down_proj"):
        issues += tensor_issues(f"{EXPERT}.{proj}.weight_scale", "e8m0", np.zeros((8, 2), np.uint8))
    (finding,) = group_issues(issues)
    assert finding.tensor == f"{EXPERT} (gate_proj, up_proj, down_proj)"
    assert finding.severity == "error" and "\n" not in finding.message and "48 E8M0" in finding.message


def test_what_counts_as_a_scale():
    mx = {"quantization_config": {"quant_method": "quark", "global_quant_config": {"weight": {
        "dtype": "fp4", "scale_format": "e8m0"}}}}
    fp8 = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert declares_mx(mx) and not declares_mx(fp8) and not declares_mx({})
    assert scale_kind("a.weight_scale", "U8", True) == "e8m0"
    assert scale_kind("a.weight_scale", "U8", False) is None
    assert scale_kind("a.weight_scale_inv", "F32", False) == "float"
    assert scale_kind("a.input_scale", "BF16", False) == "float"
    assert scale_kind("a.weight", "U8", True) is None
    assert scale_kind("m.experts.gate_up_proj_scales", "U8", True) == "e8m0"


# ---- end to end on a toy export --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exports(toy_factory, tmp_path_factory):
    from quant.pipeline import quantize_checkpoint

    src = toy_factory("qwen3-moe")
    root = tmp_path_factory.mktemp("scales")
    out = {}
    for scheme in ("w_mxfp4_a_mxfp4", "fp8-block"):
        out[scheme] = root / scheme
        quantize_checkpoint(src, out[scheme], scheme=scheme, check_engines=[], log=lambda m: None)
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite(ckpt: Path, change) -> None:
    """Rewrite every shard with `change(name, tensor) -> tensor` applied (safetensors, metadata kept)."""
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    for file in sorted(set(index.values())):
        with safe_open(str(ckpt / file), framework="pt") as f:
            meta = f.metadata()
            tensors = {n: change(n, f.get_tensor(n)) for n in f.keys()}
        save_file(tensors, str(ckpt / file), metadata=meta)


def _verify(ckpt: Path, *args):
    from quant.cli import app

    result = CliRunner().invoke(app, ["verify-manifest", str(ckpt), "--scales", "--json", *args])
    return result.exit_code, json.loads(result.stdout)


def test_a_clean_export_passes(exports):
    for ckpt in exports.values():
        code, data = _verify(ckpt)
        assert code == 0, data["findings"]
        assert not [f for f in data["findings"] if f["rule"].startswith("scales")]
        assert data["scales"]["tensors"] >= 48


def test_an_expert_of_zero_scales_is_named(exports, tmp_path):
    ckpt = _copy(exports["w_mxfp4_a_mxfp4"], tmp_path / "zero")
    _rewrite(ckpt, lambda n, t: torch.zeros_like(t) if n.startswith(EXPERT + ".") and n.endswith("weight_scale")
             else t)
    code, data = _verify(ckpt)
    assert code == 1
    scale = [f for f in data["findings"] if f["rule"].startswith("scales")]
    assert [(f["severity"], f["tensor"], f["rule"]) for f in scale] == [
        ("error", f"{EXPERT} (down_proj, gate_proj, up_proj)", "scales: e8m0-zero")]
    assert "0x00" in scale[0]["message"] and "\n" not in scale[0]["message"]
    # the human-readable report names it too, one line per finding
    from quant.cli import app

    text = CliRunner().invoke(app, ["verify-manifest", str(ckpt), "--scales"], terminal_width=200).stdout
    assert "experts.3" in text and "FAIL" in text


def test_an_nan_scale_byte_is_an_error(exports, tmp_path):
    ckpt = _copy(exports["w_mxfp4_a_mxfp4"], tmp_path / "nan")
    target = f"{EXPERT}.down_proj.weight_scale"

    def poison(name, t):
        if name == target:
            t = t.clone()
            t[0, 0] = 0xFF
        return t

    _rewrite(ckpt, poison)
    code, data = _verify(ckpt)
    assert code == 1
    scale = [f for f in data["findings"] if f["rule"].startswith("scales")]
    assert [(f["tensor"], f["rule"]) for f in scale] == [(f"{EXPERT} (down_proj)", "scales: e8m0-nan")]
    assert scale[0]["message"].startswith("1 of ")


def test_fp8_scales_zero_and_nan(exports, tmp_path):
    ckpt = _copy(exports["fp8-block"], tmp_path / "fp8")
    other = "model.layers.0.mlp.experts.5.up_proj.weight_scale_inv"

    def poison(name, t):
        if name.startswith(EXPERT + ".") and name.endswith("weight_scale_inv"):
            return torch.zeros_like(t)
        if name == other:
            t = t.clone()
            t.view(-1)[0] = float("nan")
        return t

    _rewrite(ckpt, poison)
    code, data = _verify(ckpt)
    assert code == 1
    scale = {(f["tensor"], f["rule"]) for f in data["findings"] if f["rule"].startswith("scales")}
    assert scale == {(f"{EXPERT} (down_proj, gate_proj, up_proj)", "scales: fp-zero"),
                     ("model.layers.0.mlp.experts.5 (up_proj)", "scales: fp-nonfinite")}


def test_scan_scales_is_the_hook_the_quantizer_calls(exports):
    from quant.verify.report import Finding

    assert scan_scales(exports["w_mxfp4_a_mxfp4"]) == []
    zero_blocks = group_issues(tensor_issues("x.weight_scale", "e8m0", np.zeros((1, 4), np.uint8)))
    assert all(isinstance(f, Finding) for f in zero_blocks)
