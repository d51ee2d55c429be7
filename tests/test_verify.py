"""verify-manifest on header-only toy checkpoints (glm_moe_dsa layout with an MTP layer).

Each test builds a correct Quark export, injects one defect that engines are known to fail on
and checks the finding, the engine + release it names and the exit code through the CLI; where config alone
can repair the defect, `--fix` must make it disappear.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from quant.engines import exclude_aliases, select_profiles, serving_engines
from quant.errors import QuantError, UnreadableCheckpoint
from quant.verify import fix_config, verify_checkpoint
from synthetic import (glm_moe_dsa_config, glm_moe_dsa_layout, keep_bf16_portable,
                                    keep_bf16_whole_mtp, layer_config,
                                    quark_layout, quantized_tensors, write_checkpoint)

app = typer.Typer()
from quant.commands.verify import command  # noqa: E402

app.command()(command)
runner = CliRunner()


def default_releases(engine: str) -> tuple[str, ...]:
    """The releases `--engine ENGINE` checks (engine.yaml default_releases): a finding every one of them shares
    names them all, in order."""
    return tuple(p.release for p in select_profiles([engine]))


def export(num_layers: int = 3, keep=None, **cfg_kw) -> tuple[dict, dict]:
    cfg = glm_moe_dsa_config(num_layers, **cfg_kw)
    tensors, qcfg = quark_layout(cfg, glm_moe_dsa_layout(cfg), keep=keep(cfg) if keep else None)
    return tensors, qcfg


def write(tmp_path: Path, tensors: dict, config: dict, name: str = "ckpt", shards: int = 1) -> Path:
    return write_checkpoint(tmp_path / name, config, tensors, shards=shards)


def cli(*args: str):
    result = runner.invoke(app, [str(a) for a in args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def cli_json(*args) -> tuple[int, dict]:
    result = cli(*args, "--json")
    return result.exit_code, json.loads(result.stdout)


def errors(report, engine=None, rule=None):
    return [f for f in report.errors if (engine is None or f.engine == engine) and (rule is None or rule in f.rule)]


def refixed(tmp_path: Path, ckpt: Path) -> Path:
    """A copy of `ckpt` whose config.json is the one `--fix` wrote."""
    out = tmp_path / "fixed_config.json"
    code = cli(ckpt, "--fix", out).exit_code
    assert code in (0, 1) and out.is_file()
    copy_dir = tmp_path / "fixed"
    shutil.copytree(ckpt, copy_dir)
    shutil.copy(out, copy_dir / "config.json")
    return copy_dir


def drop_excludes(config: dict, pred) -> dict:
    config = copy.deepcopy(config)
    q = config["quantization_config"]
    q["exclude"] = [e for e in q["exclude"] if not pred(e)]
    return config


# ---- correct exports -------------------------------------------------------------------------------------

def test_portable_export_passes_every_engine(tmp_path):
    ckpt = write(tmp_path, *export(), shards=3)
    code, data = cli_json(ckpt)  # without --engine: the serving engines, every default release
    assert code == 0 and data["errors"] == 0
    assert data["profiles"] == [p.label for p in select_profiles(list(serving_engines()))]
    # the excluded BF16 MTP shared expert vetoes SGLang shared-expert fusion (performance warning only)
    assert [g["rule"] for g in data["groups"]] == ["shared-expert fusion"]
    # transformers' own Quark loading cannot load its quantized routed experts (fused 3D parameters it never
    # quantizes), and that is all it finds
    code, data = cli_json(ckpt, "--engine", "all")
    assert code == 1 and "transformers==5.23" in data["profiles"]
    found = [f for f in data["findings"] if f["severity"] == "error"]
    assert found and all(f["engine"] == "transformers" and ".experts." in f["tensor"]
                         and "never quantized" in f["message"] for f in found), found


def test_whole_bf16_mtp_layer_fails_only_vllm_without_per_expert_fix(tmp_path):
    """The GLM-5.2-MXFP4 release layout (#2): MTP experts BF16, excluded per leaf."""
    ckpt = write(tmp_path, *export(keep=keep_bf16_whole_mtp))
    report = verify_checkpoint(ckpt)
    errs = report.errors
    assert errs and all(f.engine == "vllm" and f.versions == ("0.31",) for f in errs)
    assert "moe coarse prefix" in errs[0].rule and "model.layers.3.mlp.experts" in errs[0].message
    assert "--engine vllm==0.32" in errs[0].fix
    assert cli(ckpt, "-e", "sglang", "-e", "vllm==0.32").exit_code == 0
    assert cli(ckpt, "--engine", "vllm==0.31").exit_code == 1


# ---- catalogue #1: GLM-5.2 MTP excludes under checkpoint names only ----------------------------------------

def test_mtp_shared_expert_alias_missing_old_sglang(tmp_path):
    tensors, config = export()
    config = drop_excludes(config, lambda e: e.startswith(("model.decoder.", "model.eh_proj")))
    ckpt = write(tmp_path, tensors, config)
    report = verify_checkpoint(ckpt)
    sg = errors(report, "sglang", "mtp runtime names")
    shared = [f for f in sg if "model.decoder.mlp.shared_experts.gate_up_proj" in f.message]
    assert shared and shared[0].versions == ("0.5.12",)
    f = shared[0]
    assert f.tensor == "model.layers.3.mlp.shared_experts.gate_proj.weight"
    assert "as MXFP4 and expects U8 [64, 32]" in f.message and "is BF16 [32, 64]" in f.message
    assert f.fix == ("add model.decoder.mlp.shared_experts.gate_proj and model.decoder.mlp.shared_experts.up_proj "
                     "to exclude")
    assert any("model.eh_proj" in g.message for g in errors(report, "sglang", "mtp eh_proj"))
    assert not errors(report, "vllm") and not errors(report, "transformers")
    # strictest default and the pinned old release fail; the release with PR #30265 loads it
    assert cli(ckpt).exit_code == 1
    assert cli(ckpt, "--engine", "sglang==0.5.12").exit_code == 1
    assert cli(ckpt, "--engine", "sglang==0.5.19").exit_code == 0
    fixed = refixed(tmp_path, ckpt)
    assert cli(fixed).exit_code == 0
    assert set(exclude_aliases("model.layers.3.mlp.shared_experts.gate_proj", config)) <= \
        set(json.loads((fixed / "config.json").read_text())["quantization_config"]["exclude"])


def test_two_digit_mtp_layer_and_literal_layer78_mapper(tmp_path):
    """N = 78 as in GLM-5.2: the newer draft class maps model.layers.78 -> model.decoder before remapping, so
    model.layers.78.eh_proj becomes model.decoder.eh_proj and model.eh_proj must still be listed."""
    tensors, config = export(78, experts=2, first_k_dense=1)
    config = drop_excludes(config, lambda e: e.startswith(("model.decoder.", "model.eh_proj")))
    ckpt = write(tmp_path, tensors, config, shards=4)
    report = verify_checkpoint(ckpt, engines=["sglang==0.5.19"])
    msgs = [f.message for f in report.errors]
    assert len(msgs) == 1 and "SGLang builds model.eh_proj as MXFP4" in msgs[0]
    assert "maps exclude with {'model.layers.78': 'model.decoder'}" in msgs[0]
    assert cli(refixed(tmp_path, ckpt)).exit_code == 0


def test_layer_number_prefix_regex(tmp_path):
    """`re:model\\.layers\\.7` meant for layer 7 also excludes layers 70-78 (whose weights are quantized)."""
    tensors, config = export(78, experts=2, first_k_dense=1)
    config["quantization_config"]["exclude"].append(r"re:model\.layers\.7")
    report = verify_checkpoint(write(tmp_path, tensors, config, shards=4), engines=["vllm==0.32"])
    warn = [f for f in report.warnings if "layer-number prefix" in f.message]
    assert warn and "model.layers.7 vs model.layers.70" in warn[0].message
    hit = {f.tensor.split(".")[2] for f in report.errors}
    assert hit == {str(i) for i in range(7, 79) if str(i).startswith("7")}  # 78: the vLLM MTP layer
    assert all("(exclude entries: re:model\\.layers\\.7)" in f.message for f in report.errors)


# ---- catalogue #2/#3: per-expert MTP excludes vs the coarse FusedMoE prefix --------------------------------

def test_mtp_experts_without_coarse_prefix(tmp_path):
    tensors, config = export(keep=keep_bf16_whole_mtp)
    config = drop_excludes(config, lambda e: e == "model.decoder.mlp.experts")
    ckpt = write(tmp_path, tensors, config)
    report = verify_checkpoint(ckpt, engines=["sglang"])
    sg = errors(report, "sglang")
    assert len(sg) == 1 and sg[0].versions == ("0.5.12",)
    assert "model.decoder.mlp.experts (FusedMoE" in sg[0].message
    assert sg[0].fix.startswith("add model.decoder.mlp.experts to exclude")
    fixed = refixed(tmp_path, ckpt)
    assert cli(fixed, "-e", "sglang").exit_code == 0


def test_qwen35_style_mtp_experts_per_leaf(tmp_path):
    """#3: `mtp.layers.0.mlp.experts.<i>.*` excluded per leaf; vLLM queries `mtp.layers.0.mlp.experts`."""
    tensors, config = export()
    H, I = 64, 32
    exclude = config["quantization_config"]["exclude"]
    for e in range(2):
        for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            tensors[f"mtp.layers.0.mlp.experts.{e}.{proj}.weight"] = ("BF16", shape)
            exclude.append(f"mtp.layers.0.mlp.experts.{e}.{proj}")
    ckpt = write(tmp_path, tensors, config)
    report = verify_checkpoint(ckpt, engines=["vllm"])
    errs = errors(report, "vllm")
    assert len(errs) == 1 and errs[0].versions == ("0.31",)
    assert "mtp.layers.0.mlp.experts (FusedMoE, 6 expert weights)" in errs[0].message


def test_coarse_moe_exclude_asserts_in_old_vllm(tmp_path):
    tensors, config = export(keep=keep_bf16_whole_mtp)
    config["quantization_config"]["exclude"].append("model.layers.3.mlp.experts")
    report = verify_checkpoint(write(tmp_path, tensors, config), engines=["vllm"])
    errs = errors(report, "vllm")
    assert len(errs) == 1 and errs[0].versions == ("0.31",) and "AssertionError" in errs[0].message


def test_one_excluded_expert_leaf_per_release(tmp_path):
    """vLLM 0.32 builds a FusedMoE unquantized when ANY expert leaf is listed; 0.31 and SGLang ignore leaves;
    transformers builds each expert on its own."""
    tensors, config = export()
    leaf = "model.layers.1.mlp.experts.0.gate_proj"
    del tensors[leaf + ".weight"], tensors[leaf + ".weight_scale"]
    tensors[leaf + ".weight"] = ("BF16", (32, 64))
    config["quantization_config"]["exclude"].append(leaf)
    report = verify_checkpoint(write(tmp_path, tensors, config))
    by = {(f.engine, v): f for f in report.errors for v in f.versions}
    assert set(by) == {("vllm", "0.31"), ("vllm", "0.32"), ("vllm", "0.33"), ("sglang", "0.5.12"),
                      ("sglang", "0.5.19"), ("sglang", "0.5.23")}
    assert "as MXFP4" in by["vllm", "0.31"].message and leaf in by["vllm", "0.31"].message
    assert "unquantized" in by["vllm", "0.32"].message and "(and 10 more of its 12 weights)" in \
        by["vllm", "0.32"].message and "exclude lists expert leaves" in by["vllm", "0.32"].message
    assert by["sglang", "0.5.12"].fix.startswith("add model.layers.1.mlp.experts to exclude")


# ---- catalogue #4/#17: quantized eh_proj -------------------------------------------------------------------

def test_quantized_eh_proj(tmp_path):
    tensors, config = export()
    del tensors["model.layers.3.eh_proj.weight"]
    tensors.update(quantized_tensors("model.layers.3.eh_proj", (64, 128), "w_mxfp4_a_mxfp4"))
    config = drop_excludes(config, lambda e: e.endswith("eh_proj"))
    report = verify_checkpoint(write(tmp_path, tensors, config))
    errs = report.errors
    assert errs and {f.engine for f in errs} == {"vllm"} and errs[0].versions == default_releases("vllm")
    assert "mtp eh_proj" in errs[0].rule and "is U8 [64, 64] (+ weight_scale)" in errs[0].message
    assert errs[0].fix.startswith("store model.layers.3.eh_proj in BF16")


# ---- catalogue #5: fused shards that disagree -------------------------------------------------------------

def test_fused_shard_disagreement(tmp_path):
    tensors, config = export()
    p = "model.layers.1.self_attn.q_a_proj"
    del tensors[p + ".weight"], tensors[p + ".weight_scale"]
    tensors[p + ".weight"] = ("BF16", (64, 64))
    config["quantization_config"]["exclude"].append(p)
    report = verify_checkpoint(write(tmp_path, tensors, config))
    sg, vl = errors(report, "sglang", "fused shards"), errors(report, "vllm", "fused shards")
    assert sg and sg[0].versions == default_releases("sglang")
    assert ("ValueError(\"Found different quantization schemes for ['q_a_proj', 'kv_a_proj_with_mqa'] in "
            "model.layers.1.self_attn.fused_qkv_a_proj_with_mqa. SGLang requires all to use the same scheme.\")"
            ) in sg[0].message
    assert vl and "model.layers.1.self_attn.fused_qkv_a_proj. vLLM requires all to use the same scheme." \
        in vl[0].message
    assert not errors(report, "transformers")


def test_regex_hitting_fused_name(tmp_path):
    tensors, config = export()
    config["quantization_config"]["exclude"].append("re:.*kv_a_proj_with_mqa")
    report = verify_checkpoint(write(tmp_path, tensors, config), engines=["sglang==0.5.12"])
    assert any("also matches the fused module" in f.message for f in report.warnings)
    assert errors(report, "sglang", "fused shards")


# ---- catalogue #6: layer_quant_config keys not remapped for the SGLang draft -------------------------------

def test_mtp_layer_quant_config_not_remapped(tmp_path):
    tensors, config = export()
    q = config["quantization_config"]
    q["layer_quant_config"]["model.layers.3.self_attn.*"] = layer_config("fp8")
    for proj, shape in (("q_a_proj", (64, 64)), ("kv_a_proj_with_mqa", (64, 64)), ("q_b_proj", (128, 64)),
                        ("kv_b_proj", (128, 32)), ("o_proj", (64, 64))):
        module = f"model.layers.3.self_attn.{proj}"
        tensors.update(quantized_tensors(module, shape, "fp8"))
    config = drop_excludes(config, lambda e: ".self_attn." in e and "indexer" not in e
                           and e.startswith(("model.layers.3", "model.decoder")))
    ckpt = write(tmp_path, tensors, config)
    report = verify_checkpoint(ckpt)
    errs = report.errors
    assert errs and {(f.engine, f.versions) for f in errs} == {("sglang", ("0.5.12",))}
    assert all("layer_quant_config" in f.rule for f in errs)
    assert any("as MXFP4" in f.message and "F8_E4M3" in f.message for f in errs)
    fixed = refixed(tmp_path, ckpt)
    assert "model.decoder.self_attn.*" in json.loads((fixed / "config.json").read_text())[
        "quantization_config"]["layer_quant_config"]
    # What --fix cannot change: 0.5.12's DeepSeek weight loader cannot load an FP8 per-channel kv_b_proj
    # (the engine rules schemes.module_failures), the MTP layer's included.
    left = verify_checkpoint(fixed).errors
    assert {(f.engine, f.versions, f.rule) for f in left} == {("sglang", ("0.5.12",), "module scheme")}
    assert {f.tensor for f in left} == {"model.layers.3.self_attn.kv_b_proj.weight"}


# ---- catalogue #10: fnmatch globs ---------------------------------------------------------------------------

def test_fnmatch_glob_excludes_nothing_in_engines(tmp_path):
    cfg = glm_moe_dsa_config(3)
    portable = keep_bf16_portable(cfg)
    tensors, config = quark_layout(cfg, glm_moe_dsa_layout(cfg),
                                   keep=lambda m: ".self_attn." in m or portable(m))
    config = drop_excludes(config, lambda e: ".self_attn." in e and e.startswith("model.layers.") and
                           not e.startswith("model.layers.3"))
    config["quantization_config"]["exclude"].append("*self_attn*")
    ckpt = write(tmp_path, tensors, config)
    report = verify_checkpoint(ckpt)
    globs = [f for f in report.warnings if "exclude glob" in f.rule]
    assert {f.engine for f in globs} == {"sglang", "vllm"}
    assert "re:" in globs[0].fix
    assert errors(report, "sglang") and errors(report, "vllm") and not errors(report, "transformers")
    assert cli(refixed(tmp_path, ckpt)).exit_code == 0


# ---- catalogue #13/#14: MTP layers ---------------------------------------------------------------------------

def test_declared_mtp_layer_missing(tmp_path):
    tensors, config = export()
    tensors = {k: v for k, v in tensors.items() if not k.startswith("model.layers.3.")}
    report = verify_checkpoint(write(tmp_path, tensors, config))
    vl = errors(report, "vllm", "mtp layer missing")
    assert vl and "MTP speculative decoding layer 3 weights missing" in vl[0].message
    assert vl[0].versions == default_releases("vllm")
    assert cli(tmp_path / "ckpt").exit_code == 1


def test_undeclared_mtp_layer(tmp_path):
    tensors, config = export()
    config["num_nextn_predict_layers"] = 0
    report = verify_checkpoint(write(tmp_path, tensors, config))
    assert any("beyond num_hidden_layers" in f.message for f in report.warnings)


# ---- catalogue #18: config schema -------------------------------------------------------------------------

@pytest.mark.parametrize("defect,engines_hit", [
    ("no_export", {"sglang", "vllm"}),
    ("kv_cache_group_null", {"sglang", "vllm"}),
    ("no_exclude", {"sglang", "vllm", "transformers"}),
    ("layer_config_keys", {"transformers"}),
])
def test_config_schema(tmp_path, defect, engines_hit):
    tensors, config = export()
    q = config["quantization_config"]
    if defect == "no_export":
        del q["export"]
    elif defect == "kv_cache_group_null":
        q["export"]["kv_cache_group"] = None
    elif defect == "no_exclude":
        del q["exclude"]
    else:
        del q["global_quant_config"]["bias"]
    ckpt = write(tmp_path, tensors, config)
    report = verify_checkpoint(ckpt, engines=["all"])
    schema = [f for f in report.errors if "config schema" in f.rule]
    assert {f.engine for f in schema} == engines_hit
    if defect == "no_export":
        assert "The export key should be included" in schema[0].message
    if defect == "no_exclude":  # newer SGLang defaults a missing exclude to []
        assert [f.versions for f in schema if f.engine == "sglang"] == [("0.5.12",)]
    assert cli(ckpt, "--engine", "all").exit_code == 1
    fixed = refixed(tmp_path, ckpt)
    assert not [f for f in verify_checkpoint(fixed, engines=["all"]).errors if "config schema" in f.rule]


def test_kv_cache_group_without_layer_config(tmp_path):
    tensors, config = export()
    config["quantization_config"]["export"]["kv_cache_group"] = ["*k_proj", "*v_proj"]
    report = verify_checkpoint(write(tmp_path, tensors, config), engines=["sglang", "vllm"])
    kv = [f for f in report.errors if f.rule == "kv cache"]
    assert {f.engine for f in kv} == {"sglang", "vllm"} and "kv_cache_group parameter setting" in kv[0].message


# ---- catalogue #19: unsupported schemes ----------------------------------------------------------------------

def _with_global(config: dict, **changes) -> dict:
    config = copy.deepcopy(config)
    g = config["quantization_config"]["global_quant_config"]
    for key, value in changes.items():
        if key == "input_is_dynamic":
            g["input_tensors"]["is_dynamic"] = value
        else:
            g[key] = value
    return config


def test_weight_only_mxfp4(tmp_path):
    tensors, config = export()
    report = verify_checkpoint(write(tmp_path, tensors, _with_global(config, input_tensors=None)))
    hit = {(f.engine, v) for f in report.errors if "unsupported scheme" in f.rule for v in f.versions}
    assert hit == {("sglang", "0.5.12"), ("sglang", "0.5.19"), ("sglang", "0.5.23"), ("vllm", "0.31")}
    sg = [f for f in report.errors if f.engine == "sglang" and "linear" in f.message]
    assert "No quark compatible scheme was found" in sg[0].message
    assert any("Unsupported FusedMoe scheme" in f.message for f in report.errors if f.engine == "sglang")


def test_weight_only_fp8_and_static_mx_and_quantized_output(tmp_path):
    tensors, config = export()
    fp8 = copy.deepcopy(config)
    fp8["quantization_config"]["global_quant_config"] = dict(layer_config("fp8"), input_tensors=None)
    r1 = verify_checkpoint(write(tmp_path, tensors, fp8, "fp8"), engines=["sglang", "vllm"])
    assert {f.engine for f in r1.errors if "unsupported scheme" in f.rule} == {"sglang", "vllm"}
    r2 = verify_checkpoint(write(tmp_path, tensors, _with_global(config, input_is_dynamic=False), "static"),
                           engines=["vllm==0.32"])
    assert any("static input scales" in f.message for f in r2.errors)
    out = _with_global(config, output_tensors={"dtype": "fp8_e4m3", "qscheme": "per_tensor"})
    r3 = verify_checkpoint(write(tmp_path, tensors, out, "out"), engines=["sglang", "vllm"])
    assert any("output_tensors and bias quantized" in f.message for f in r3.errors)


# ---- tensor contract -----------------------------------------------------------------------------------------

def test_tp_split_of_row_parallel_layer(tmp_path):
    ckpt = write(tmp_path, *export())
    assert cli(ckpt, "--tp", "1").exit_code == 0
    report = verify_checkpoint(ckpt, engines=["vllm==0.32"], tp=4)
    tp = [f for f in report.errors if "(TP)" in f.rule]
    assert tp and all(f.tensor.endswith((".o_proj.weight", ".down_proj.weight")) for f in tp)
    assert "in/TP = 64/4 divisible by 32" in tp[0].message


def test_wrong_scale_shape_and_grouping(tmp_path):
    tensors, config = export()
    for name, (dtype, shape) in list(tensors.items()):
        if name.endswith("experts.0.down_proj.weight_scale"):
            tensors[name] = ("F8_E8M0", shape)  # scales must be stored as U8
    ckpt = write(tmp_path, tensors, config)
    report = verify_checkpoint(ckpt, engines=["vllm==0.32"])
    bad = [f for f in report.errors if f.rule == "tensor contract"]
    assert {f.tensor for f in bad} == {f"model.layers.{i}.mlp.experts.0.down_proj.weight_scale" for i in (1, 2, 3)}
    groups = [g for g in report.groups() if g.rule == "tensor contract"]
    assert len(groups) == 1 and groups[0].count == 3 and "layers.{L}" in groups[0].tensor
    result = cli(ckpt, "-e", "vllm==0.32")
    assert result.exit_code == 1 and "(x3)" in result.stdout


def test_fp8_static_input_needs_input_scale(tmp_path):
    tensors, config = export()
    fp8 = {}
    for name, (dtype, shape) in tensors.items():
        if name.endswith(".weight_scale"):
            continue
        if dtype == "U8":
            module = name[: -len(".weight")]
            fp8.update({name: ("F8_E4M3", (shape[0], shape[1] * 2)), module + ".weight_scale": ("F32", ())})
        else:
            fp8[name] = (dtype, shape)
    static = dict(layer_config("fp8"))
    static["weight"] = dict(static["weight"], qscheme="per_tensor")
    static["input_tensors"] = dict(static["input_tensors"], qscheme="per_tensor", is_dynamic=False)
    config["quantization_config"]["global_quant_config"] = static
    report = verify_checkpoint(write(tmp_path, fp8, config), engines=["sglang==0.5.19"])
    missing = [f for f in report.errors if f.rule == "tensor contract"]
    assert missing and all(f.tensor.endswith(".input_scale") and "absent" in f.message for f in missing)


# ---- integrity, exit codes, --fix safety -----------------------------------------------------------------

def test_integrity_problems(tmp_path):
    tensors, config = export()
    ckpt = write(tmp_path, tensors, config, shards=2)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.9.ghost.weight"] = index["weight_map"]["lm_head.weight"]
    index["weight_map"]["model.layers.8.lost.weight"] = "../outside.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    code, data = cli_json(ckpt)
    kinds = {f["rule"] for f in data["findings"] if f["engine"] == "all"}
    assert code == 2 and {"integrity: missing-tensor", "integrity: unsafe-path"} <= kinds  # unsafe path: unreadable


def test_unreadable_checkpoint_exit_code(tmp_path):
    (tmp_path / "empty").mkdir()
    result = runner.invoke(app, [str(tmp_path / "empty")])
    assert isinstance(result.exception, UnreadableCheckpoint) and result.exception.exit_code == 2
    with pytest.raises(UnreadableCheckpoint):
        verify_checkpoint(tmp_path / "missing")
    proc = subprocess.run([sys.executable, "-m", "quant.cli", "verify-manifest", str(tmp_path / "empty")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr


def test_fix_refuses_the_original_config(tmp_path):
    ckpt = write(tmp_path, *export())
    with pytest.raises(QuantError, match="refusing"):
        fix_config(ckpt, ckpt / "config.json")
    before = (ckpt / "config.json").read_text()
    result = runner.invoke(app, [str(ckpt), "--fix", str(ckpt / "." / "config.json")])
    assert isinstance(result.exception, QuantError)
    assert (ckpt / "config.json").read_text() == before


def test_not_a_quark_checkpoint(tmp_path):
    tensors, config = export()
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert cli(write(tmp_path, tensors, config)).exit_code == 1


def test_unknown_engine_release(tmp_path):
    ckpt = write(tmp_path, *export())
    with pytest.raises(QuantError, match="unknown sglang release"):
        verify_checkpoint(ckpt, engines=["sglang==9.9"])


def test_pattern_hygiene_warnings(tmp_path):
    tensors, config = export()
    config["quantization_config"]["exclude"] += ["re:model.layers.1.mlp.gate", "shared_experts.down_proj",
                                                 "model.layers.1.mlp.gatex"]
    report = verify_checkpoint(write(tmp_path, tensors, config))
    text = {f.message for f in report.warnings if f.rule == "pattern hygiene"}
    assert any("unescaped '.'" in m and "model.layers.1.mlp.gate" in m for m in text)
    assert any("engines do not match substrings" in m for m in text)
    assert any("'model.layers.1.mlp.gatex' matches no module" in m for m in text)
    assert report.exit_code == 0


@pytest.mark.parametrize("glob", ["*self_attn*", "model.layers.*.mlp.gate", "lm_head", "*.experts.?.up_proj",
                                  "model.layers.1.*"])
def test_glob_fix_matches_what_quark_matches(glob):
    import fnmatch
    import re

    from quant.verify.hygiene import glob_to_regex
    rx = re.compile(glob_to_regex(glob)[3:])
    names = list(glm_moe_dsa_layout(glm_moe_dsa_config(3)))
    modules = {n.rsplit(".", 1)[0] for n in names} | {"lm_head.extra"}
    hits = {m for m in modules if fnmatch.fnmatch(m, glob) or fnmatch.fnmatch(m, glob + ".*")}
    assert hits and {m for m in modules if rx.match(m)} == hits


def test_exclude_aliases_interface():
    config = {"num_hidden_layers": 78, "num_nextn_predict_layers": 1}
    assert exclude_aliases("model.layers.78.mlp.shared_experts.gate_proj", config) == [
        "model.layers.78.mlp.shared_experts.gate_proj", "model.decoder.mlp.shared_experts.gate_proj"]
    assert exclude_aliases("model.layers.78.eh_proj", config) == ["model.layers.78.eh_proj", "model.eh_proj"]
    assert exclude_aliases("model.layers.78.mlp.experts.5.down_proj", config) == [
        "model.layers.78.mlp.experts.5.down_proj", "model.decoder.mlp.experts.5.down_proj",
        "model.decoder.mlp.experts"]
    assert exclude_aliases("model.layers.7.mlp.shared_experts.gate_proj", config) == [
        "model.layers.7.mlp.shared_experts.gate_proj"]
    assert exclude_aliases("lm_head", config) == ["lm_head"]


def test_fix_never_replaces_an_existing_file_without_overwrite(tmp_path):
    ckpt = write(tmp_path, *export())
    mine = tmp_path / "notes.json"
    mine.write_text("a user's file")
    result = runner.invoke(app, [str(ckpt), "--fix", str(mine)])
    assert isinstance(result.exception, QuantError) and result.exception.exit_code == 2
    assert "--overwrite" in str(result.exception) and mine.read_text() == "a user's file"
    result = runner.invoke(app, [str(ckpt), "--fix", str(mine), "--overwrite"])
    assert result.exit_code in (0, 1) and mine.read_text() != "a user's file"


def test_an_absurd_expert_count_is_named_by_its_key(toy_factory, tmp_path):
    """Issue #49: a config declaring 10^12 routed experts was refused without naming the key it was read from."""
    import shutil

    from quant.verify import verify_checkpoint

    ckpt = Path(shutil.copytree(toy_factory("deepseek-v3"), tmp_path / "absurd"))
    config = json.loads((ckpt / "config.json").read_text())
    config["n_routed_experts"] = 10 ** 12
    (ckpt / "config.json").write_text(json.dumps(config))
    messages = [f.message for f in verify_checkpoint(ckpt).findings if "experts config.json declares" in f.message]
    assert messages and all("1000000000000" in m and "(n_routed_experts)" in m for m in messages), messages
