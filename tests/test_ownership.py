"""A user's files are sacred: every command that writes (toy, quantize, eval --out, eval --card, demo) refuses a
directory it did not make unless --overwrite, never deletes a file it did not write, and refuses the working
directory, the home directory and its own inputs outright (quant/ownership.py). Also: schemes that work with
their defaults, and model cards whose commands run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from evals.card import add_accuracy
from quant.errors import QuantError
from quant.pipeline import quantize_checkpoint

QUANT = [sys.executable, "-m", "quant.cli"]


def quant(*args, cwd=None, env=None):
    return subprocess.run(QUANT + [str(a) for a in args], capture_output=True, text=True, timeout=600, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent), **(env or {})})


def user_dir(path: Path) -> dict[str, str]:
    path.mkdir(parents=True, exist_ok=True)
    files = {"notes.txt": "my notes", "README.md": "# my own readme", "data/keep.jsonl": "{}"}
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    return files


def assert_intact(path: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        assert (path / name).read_text() == text, name


@pytest.mark.parametrize("command", [
    ["demo", "{out}", "--limit", "5"],
    ["toy", "glm5", "{out}"],
    ["quantize", "{src}", "{out}", "--no-progress"],
    ["eval", "--candidate", "{src}", "--baseline", "{src2}", "--tasks", "toy_arith", "--limit", "2", "--out", "{out}"],
])
def test_every_command_refuses_a_users_directory_and_keeps_its_files(toy_factory, tmp_path, command):
    src = toy_factory("qwen3-moe")
    src2 = toy_factory("deepseek-v3")
    out = tmp_path / "mine"
    files = user_dir(out)
    args = [a.format(out=out, src=src, src2=src2) for a in command]
    result = quant(*args)
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip().splitlines()
    assert len(line) == 1 and str(out) in line[0] and "--overwrite" in line[0], result.stderr
    assert_intact(out, files)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "data", "notes.txt"]  # not even a lock file


@pytest.mark.parametrize("command", [["demo", "."], ["toy", "glm5", ".", "--force"],
                                     ["quantize", "{src}", ".", "--overwrite"],
                                     ["eval", "--candidate", "{src}", "--baseline", "{src2}", "--out", ".",
                                      "--overwrite"]])
def test_the_working_directory_is_refused_outright(toy_factory, tmp_path, command):
    files = user_dir(tmp_path / "cwd")
    args = [a.format(src=toy_factory("qwen3-moe"), src2=toy_factory("deepseek-v3")) for a in command]
    result = quant(*args, cwd=tmp_path / "cwd")
    assert result.returncode == 2 and "working directory" in result.stderr, result.stderr
    assert_intact(tmp_path / "cwd", files)


def test_the_home_directory_is_refused_outright(tmp_path):
    home = tmp_path / "home"
    files = user_dir(home)
    result = quant("toy", "glm5", home, "--overwrite", env={"HOME": str(home)})
    assert result.returncode == 2 and "home directory" in result.stderr, result.stderr
    assert_intact(home, files)


def test_overwrite_writes_beside_foreign_files_and_deletes_none(toy_factory, tmp_path):
    out = tmp_path / "mine"
    files = {k: v for k, v in user_dir(out).items() if k != "README.md"}
    quantize_checkpoint(toy_factory("qwen3-moe"), out, overwrite=True, log=lambda m: None)
    assert_intact(out, files)
    assert (out / "config.json").is_file()


def test_quantize_refuses_another_export_and_overwrite_removes_only_its_own_files(toy_factory, tmp_path):
    src = toy_factory("qwen3-moe", shard_size="300KB")
    out = tmp_path / "q"
    quantize_checkpoint(src, out, log=lambda m: None)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1
    (out / "mine.txt").write_text("a user's file")
    with pytest.raises(QuantError, match="another job.*scheme 'w_mxfp4_a_mxfp4', not 'fp8'.*--overwrite") as e:
        quantize_checkpoint(src, out, scheme="fp8", log=lambda m: None)
    assert e.value.exit_code == 2
    other = toy_factory("qwen3-moe")  # one shard: the earlier export's other shards must not stay behind
    quantize_checkpoint(other, out, overwrite=True, log=lambda m: None)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(set(index["weight_map"].values()))
    assert (out / "mine.txt").read_text() == "a user's file"


def test_requantizing_keeps_the_cards_accuracy_section_and_refuses_hand_edits(toy_factory, tmp_path):
    src = toy_factory("qwen3-moe")
    out = tmp_path / "q"
    quantize_checkpoint(src, out, log=lambda m: None)
    report = {"verdict": "pass", "margin_points": 2.0, "baseline": {"name": "fp8"}, "rows": []}
    (tmp_path / "r").mkdir()
    add_accuracy(out, report, tmp_path / "r")
    assert "overall verdict **pass**" in (out / "README.md").read_text()
    quantize_checkpoint(src, out, log=lambda m: None)  # the same job: resumes, the accuracy stays
    assert "overall verdict **pass**" in (out / "README.md").read_text()
    (out / "README.md").write_text((out / "README.md").read_text() + "\nMy own deployment notes.\n")
    with pytest.raises(QuantError, match="README.md: the model card was edited"):
        quantize_checkpoint(src, out, log=lambda m: None)
    assert "My own deployment notes." in (out / "README.md").read_text()
    quantize_checkpoint(src, out, overwrite=True, log=lambda m: None)
    assert "My own deployment notes." in (out / "README.md.edited").read_text()


def test_eval_card_writes_only_into_our_exports(toy_factory, tmp_path):
    from evals.card import check_card_target

    files = user_dir(tmp_path / "mine")
    with pytest.raises(QuantError, match="not an export written by quant quantize"):
        check_card_target(tmp_path / "mine")
    assert_intact(tmp_path / "mine", files)
    out = tmp_path / "q"
    quantize_checkpoint(toy_factory("qwen3-moe"), out, log=lambda m: None)
    check_card_target(out)


def test_weight_only_mxfp4_works_with_its_defaults_and_its_card_names_only_vllm(toy_factory, tmp_path):
    out = tmp_path / "w"
    manifest = quantize_checkpoint(toy_factory("glm5"), out, scheme="w_mxfp4", log=lambda m: None)
    assert manifest["engines"]["checked"] == ["vllm==latest"]
    card = (out / "README.md").read_text()
    assert "vllm serve ." in card and "sglang" not in card.split("## Serve")[1].split("## Accuracy")[0].lower() \
        .replace("sglang cannot load", "")
    assert "SGLang cannot load this scheme" in card


def test_a_custom_recipe_is_saved_beside_the_card_and_its_reproduce_line_runs(toy_factory, tmp_path):
    recipe = tmp_path / "my-recipe.yaml"
    recipe.write_text("base: experts-only\nroles: {attention: fp8}\n")
    src = toy_factory("qwen3-moe")
    out = tmp_path / "q"
    quantize_checkpoint(src, out, recipe=str(recipe), log=lambda m: None)
    assert (out / "quant_recipe.yaml").read_text() == recipe.read_text()
    card = (out / "README.md").read_text()
    line = next(l for l in card.splitlines() if l.startswith("quant quantize "))
    assert "--recipe quant_recipe.yaml" in line
    # the reproduce line, run from the export's directory with SOURCE filled in, gives the same shards
    args = line.split()[1:]
    assert args[1] == "SOURCE"
    args[1] = str(src)
    result = quant(*args, "--no-progress", cwd=out)
    assert result.returncode == 0, result.stderr
    again = Path(out / args[2]).resolve()
    for shard in out.glob("*.safetensors"):
        assert (again / shard.name).read_bytes() == shard.read_bytes()


def test_a_recipe_typo_is_exit_2_naming_the_key(toy_factory, tmp_path):
    recipe = tmp_path / "typo.yaml"
    recipe.write_text("base: experts-only\nmtp_layr: bf16\n")
    result = quant("quantize", toy_factory("glm5"), tmp_path / "q", "--recipe", recipe, "--no-progress")
    assert result.returncode == 2 and "mtp_layr" in result.stderr, result.stderr
    assert not (tmp_path / "q").exists()


def test_a_failed_calibration_leaves_no_directory_behind(toy_factory, tmp_path):
    bad = tmp_path / "cal.jsonl"
    bad.write_text('hello\n{"text": "broken\n')
    out = tmp_path / "q"
    result = quant("quantize", toy_factory("qwen3-moe"), out, "--method", "gptq", "--calib-data", bad,
                   "--calib-samples", "2", "--calib-seq-len", "16", "--no-progress")
    assert result.returncode == 2 and "cal.jsonl:1" in result.stderr, result.stderr
    assert not out.exists()


def test_a_broken_line_in_a_gsm8k_file_is_one_line_exit_2_before_any_work(tmp_path):
    data = tmp_path / "gsm"
    data.mkdir()
    record = json.dumps({"question": "1+1?", "answer": "#### 2"})
    (data / "train.jsonl").write_text(record + "\n")
    (data / "test.jsonl").write_text(record + "\n" + '{"question": "broken\n')
    result = quant("eval", "--candidate", Path(__file__).parent.parent / "evals" / "data" / "toy_arith" / "model",
                   "--baseline", "http://127.0.0.1:9/v1", "--tasks", "gsm8k", "--data-dir", data,
                   "--out", tmp_path / "out")
    assert result.returncode == 2 and "test.jsonl:2: not a JSON object" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()
