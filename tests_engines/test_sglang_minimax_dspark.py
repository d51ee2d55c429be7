"""MiniMax-M3.1-Flash's DSpark draft under SGLang 0.5.23 (issue #43 item 4): the toy's draft file (the minimax_m3_vl
family's `dspark` sidecar, dspark.safetensors beside the shards), carried over by `quant quantize`, is selected by
SGLang's own weight-file selection, and DSparkMiniMaxDraftModel, built from the export's config.json through
configure_minimax_m3_dspark with the quant config SGLang derives from the export, loads it through its own
load_weights on CPU (tests_engines/sglang_dspark_probe.py says what it calls and why). Where `quant verify-manifest`
fails an export (draft file missing), SGLang's loader fails too; an exclude without the draft's linears makes SGLang
build them quantized, which the BF16 draft cannot load into.

    .venv-sglang/bin/python -m pytest -q -p no:cacheprovider tests_engines/test_sglang_minimax_dspark.py
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests_engines.cases import sglang_command

PROBE = Path(__file__).resolve().parent / "sglang_dspark_probe.py"
DRAFT = "dspark.safetensors"
# The Quark KV-cache scales the export's quantization_config gives every attention (module defaults, no tensor).
DEFAULTS = ("self_attn.attn.k_scale", "self_attn.attn.v_scale")


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from quant.pipeline.run import quantize_checkpoint
    from quant.toy import build_toy

    root = tmp_path_factory.mktemp("m31-dspark")
    quantize_checkpoint(build_toy("minimax-m3.1-flash", root / "t"), root / "t-mx")
    return root / "t-mx"


def _probe(path: Path) -> dict:
    command, env = sglang_command("0.5.23")
    proc = subprocess.run([command[0], str(PROBE), str(path)], capture_output=True, text=True, env=env,
                          timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1])


def _preflight_errors(path: Path) -> list[dict]:
    run = subprocess.run([sys.executable, "-m", "quant", "verify-manifest", str(path), "--json"],
                         capture_output=True, text=True)
    return [f for f in json.loads(run.stdout)["findings"] if f["severity"] == "error"]


def _copy(export: Path, out: Path, change) -> Path:
    shutil.copytree(export, out)
    change(out)
    return out


def test_sglang_loads_the_exported_draft_file(export):
    result = _probe(export)
    assert result["outcome"] == "loaded", result.get("trace") or result
    assert result["bundles"] and result["files"] == [DRAFT, "model.safetensors"]
    assert not result["mismatched"]
    assert all(name.endswith(DEFAULTS) for name in result["unwritten"]), result["unwritten"]
    # Every linear of the draft unquantized: the export's exclude names them (the draft shares the target's config).
    linears = {n: m for n, m in result["quant_methods"].items() if not n.endswith(".attn")}
    assert linears and set(linears.values()) == {"UnquantizedLinearMethod"}, linears
    assert result["params"]["fc.weight"] == [[160, 320], "torch.bfloat16"]
    assert result["params"]["layers.0.decoder_layer.mlp.down_proj.weight"] == [[160, 384], "torch.bfloat16"]
    assert not _preflight_errors(export)


def test_without_the_draft_file_sglang_fails_as_the_preflight_does(export, tmp_path):
    def drop(out: Path):
        (out / DRAFT).unlink()
        index = json.loads((out / "model.safetensors.index.json").read_text())
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != DRAFT}
        (out / "model.safetensors.index.json").write_text(json.dumps(index))

    broken = _copy(export, tmp_path / "no-draft", drop)
    result = _probe(broken)
    assert result["outcome"] == "load-error" and "Missing DSpark checkpoint tensors" in result["error"], result
    assert [e["tensor"] for e in _preflight_errors(broken)] == [DRAFT]


def test_an_exclude_without_the_draft_linears_makes_sglang_quantize_them(export, tmp_path):
    def unexclude(out: Path):
        config = json.loads((out / "config.json").read_text())
        q = config["quantization_config"]
        q["exclude"] = [e for e in q["exclude"] if ".dspark." not in e]
        (out / "config.json").write_text(json.dumps(config))

    broken = _copy(export, tmp_path / "unexcluded", unexclude)
    result = _probe(broken)
    assert result["quant_methods"]["fc"] == "QuarkLinearMethod", result["quant_methods"]
    # The MXFP4 fc weight is packed [160, 160]; the draft file's is BF16 [160, 320].
    assert result["outcome"] == "load-error" and "shape" in result["error"], result
    named = {e["tensor"] for e in _preflight_errors(broken) if e["engine"].startswith("sglang")}
    assert {"language_model.model.dspark.fc.weight",
            "language_model.model.dspark.layers.0.decoder_layer.self_attn.q_proj.weight"} <= named


STACKED = ((".q_proj.", ".qkv_proj."), (".k_proj.", ".qkv_proj."), (".v_proj.", ".qkv_proj."),
           (".gate_proj.", ".gate_up_proj."), (".up_proj.", ".gate_up_proj."))  # dspark_minimax.py:278-284


def _contents(path: Path):
    from quant.families import load_family, text_config
    from quant.families.sidecars import expected_sidecars

    config = json.loads((path / "config.json").read_text())
    [expected] = expected_sidecars(load_family("minimax_m3_vl").sidecars, text_config(config))
    return expected.contents


def test_the_family_lists_the_parameters_the_draft_class_allocates(export):
    """The family's `dspark` contents, stacked as load_weights stacks them, are DSparkMiniMaxDraftModel's
    parameters (its attention's KV-cache scales aside: module defaults, no tensor); the optional ones (the confidence
    head) are what the default static verify mode does not build, and its loader skips (dspark_minimax.py:291-292)."""
    result = _probe(export)
    ours: dict[bool, set] = {True: set(), False: set()}
    for name, want in _contents(export).items():
        short = name.removeprefix("language_model.model.dspark.")
        for part, stacked in STACKED:
            short = short.replace(part, stacked)
        ours[want.required].add(short)
    theirs = {n for n in result["params"] if not n.endswith(DEFAULTS)}
    assert ours[True] == theirs, (sorted(ours[True] - theirs), sorted(theirs - ours[True]))
    assert ours[False] == {"confidence_head.proj.weight", "confidence_head.proj.bias"}
    assert result["outcome"] == "loaded"  # the export's draft holds them: skipped, not refused


@pytest.mark.parametrize("case", ["missing", "shape", "unexpected"])
def test_a_draft_tensor_sglang_cannot_load_is_what_the_preflight_names(export, tmp_path, case):
    from safetensors.torch import load_file, save_file

    w1 = "language_model.model.dspark.markov_head.markov_w1.weight"
    fc = "language_model.model.dspark.fc.weight"

    def change(out: Path):
        tensors = load_file(out / DRAFT)
        if case == "missing":
            tensors.pop(w1)
        elif case == "shape":
            tensors[fc] = tensors[fc][:, :-32].clone()
        else:
            tensors[fc.replace(".fc.", ".fc2.")] = tensors[fc].clone()
        save_file(tensors, out / DRAFT, metadata={"format": "pt"})
        index = json.loads((out / "model.safetensors.index.json").read_text())
        index["weight_map"] = {**{k: v for k, v in index["weight_map"].items() if v != DRAFT},
                               **dict.fromkeys(tensors, DRAFT)}
        (out / "model.safetensors.index.json").write_text(json.dumps(index))

    broken = _copy(export, tmp_path / case, change)
    result = _probe(broken)
    says = {"missing": "Missing DSpark checkpoint tensors", "shape": "shape", "unexpected": "Unexpected DSpark"}[case]
    assert result["outcome"] == "load-error" and says in result["error"], result
    named = {e["tensor"] for e in _preflight_errors(broken) if "draft class" in e["message"]}
    assert named == {w1 if case == "missing" else fc if case == "shape" else fc.replace(".fc.", ".fc2.")}
