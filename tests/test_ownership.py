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

from evals.report.card import add_accuracy
from quant.errors import QuantError
from quant.pipeline import quantize_checkpoint

QUANT = [sys.executable, "-m", "quant.cli"]
TOY_ARITH = Path(__file__).parent.parent / "evals" / "data" / "toy_arith" / "model"


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


@pytest.mark.parametrize("command", [["demo", "."], ["toy", "glm5", ".", "--overwrite"],
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


def test_overwrite_writes_beside_foreign_files_and_overwrites_none(toy_factory, tmp_path):
    out = tmp_path / "mine"
    files = user_dir(out)
    # The user's README.md stands where the model card goes: refused before any work, even with --overwrite.
    with pytest.raises(QuantError, match="mine/README.md: exists and was not written by this tool") as e:
        quantize_checkpoint(toy_factory("qwen3-moe"), out, overwrite=True, log=lambda m: None)
    assert e.value.exit_code == 2
    assert_intact(out, files)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "data", "notes.txt"]  # no bookkeeping left
    (out / "README.md").rename(tmp_path / "README.md")
    files.pop("README.md")
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
    for overwrite in (False, True):  # a card edited by hand is never overwritten, flag or not
        with pytest.raises(QuantError, match="README.md: exists and was not written by this tool \\(or was changed"):
            quantize_checkpoint(src, out, overwrite=overwrite, log=lambda m: None)
        assert "My own deployment notes." in (out / "README.md").read_text()


def test_eval_card_writes_only_into_our_exports(toy_factory, tmp_path):
    from evals.report.card import check_card_target

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
    # the vLLM releases whose Quark linear and FusedMoE build weight-only MXFP4 (engine rules `schemes`)
    assert manifest["engines"]["checked"] == ["vllm==0.32", "vllm==0.33"]
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


# --- ownership by what a path really is (symlinks, forged owner records, --overwrite) ---------------------------

@pytest.fixture(scope="module")
def arith_copy(tmp_path_factory):
    """A second copy of the trained toy with one file more: an eval's baseline (a model is never compared with
    itself, a byte-identical copy included)."""
    import shutil

    copy = shutil.copytree(TOY_ARITH, tmp_path_factory.mktemp("arith") / "copy")
    (copy / "NOTES.md").write_text("another checkpoint directory\n")
    return copy


def tree(root: Path) -> dict[str, str]:
    """Every entry under `root` (symlinks as links, never followed)."""
    out = {}
    for parent, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(parent) / name
            out[str(p.relative_to(root))] = "->" + os.readlink(p) if p.is_symlink() else \
                (p.read_bytes().hex() if p.is_file() else "dir")
    return out


def one_line(result, code: int, *phrases: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for phrase in phrases:
        assert phrase in lines[0], result.stderr


def test_an_output_that_is_a_link_to_the_source_is_refused(toy_factory, tmp_path):
    src = tmp_path / "src6"
    import shutil

    shutil.copytree(toy_factory("glm5", shard_size="300KB"), src)
    link = tmp_path / "srclink6"
    link.symlink_to(src)
    before = tree(src)
    one_line(quant("quantize", src, link, "--overwrite", "--no-progress"), 2, "source checkpoint")
    assert tree(src) == before


@pytest.mark.parametrize("command", [["toy", "glm5", "{out}", "--overwrite"],
                                     ["quantize", "{src}", "{out}", "--overwrite", "--no-progress"],
                                     ["eval", "--candidate", "{src}", "--baseline", "{src2}", "--tasks", "toy_arith",
                                      "--limit", "2", "--out", "{out}", "--overwrite"]])
def test_an_output_that_is_a_link_to_the_home_directory_is_refused(toy_factory, tmp_path, command):
    home = tmp_path / "home"
    files = user_dir(home)
    (home / "session.tmp").write_text("a session")
    (home / "work").mkdir()
    (home / "config.json").write_text("{}")
    before = tree(home)
    out = tmp_path / "out"
    out.symlink_to(home)
    args = [a.format(out=out, src=toy_factory("qwen3-moe"), src2=toy_factory("deepseek-v3")) for a in command]
    one_line(quant(*args, env={"HOME": str(home)}), 2, "home directory")
    assert tree(home) == before
    assert_intact(home, files)


def test_eval_out_through_a_link_into_the_candidate_is_refused(tmp_path):
    import shutil

    cand = tmp_path / "cand"
    shutil.copytree(TOY_ARITH, cand)
    before = tree(cand)
    (tmp_path / "link").symlink_to(cand)
    one_line(quant("eval", "--candidate", cand, "--baseline", TOY_ARITH, "--tasks", "toy_arith", "--limit", "2",
                   "--out", tmp_path / "link" / "eval-out"), 2, "candidate")
    assert tree(cand) == before


@pytest.mark.parametrize("forged", [["../victim2"], ["/ABS/victim.txt"], ["runs/../../victim2"]])
@pytest.mark.parametrize("version", [None, 2])
def test_a_forged_owner_record_is_not_ours(tmp_path, forged, version):
    victim = tmp_path / "victim2"
    files = user_dir(victim)
    (tmp_path / "victim.txt").write_text("mine")
    out = tmp_path / "c2"
    out.mkdir()
    names = [f.replace("/ABS", str(tmp_path)) for f in forged]
    record = {"tool": "moe-quant", "kind": "toy", "identity": None, "written": names} if version is None else \
        {"tool": "moe-quant", "version": 2, "kind": "toy", "identity": None, "dirs": [],
         "files": {n: [4, "0" * 64] for n in names}}
    (out / ".quant-owner.json").write_text(json.dumps(record))
    for flags in ([], ["--overwrite"]):
        one_line(quant("toy", "glm5", out, *flags), 2, ".quant-owner.json", "not ours")
        assert_intact(victim, files)
        assert (tmp_path / "victim.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == [".quant-owner.json"]


def test_eval_overwrite_keeps_every_user_file_and_refuses_its_own_names(tmp_path, arith_copy):
    out = tmp_path / "dir"
    files = {"work/w.txt": "w", "hf_datasets_cache/c.txt": "c", "data/d.jsonl": "{}", "tasks/t.yaml": "t: 1",
             "notes.txt": "n", "session.tmp": "s", ".tmpAb12Cd": "x"}
    for name, text in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    args = ["eval", "--candidate", TOY_ARITH, "--baseline", arith_copy, "--tasks", "toy_arith", "--limit", "2",
            "--max-gen-toks", "4", "--seeds", "1", "--dtype", "float32", "--out", out, "--overwrite"]
    for name in ("report.md", "runs/mine.txt"):  # a file of the user's where the eval writes: refused first
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("the user's")
        one_line(quant(*args), 2, name, "not written by this tool")
        assert (out / name).read_text() == "the user's"
        (out / name).unlink()
    assert_intact(out, files)
    (out / "runs").rmdir()
    result = quant(*args)
    assert result.returncode in (0, 1, 3, 4), result.stderr
    assert_intact(out, files)
    (out / "runs" / "mine.txt").write_text("the user's, in runs/ after the eval")
    one_line(quant(*args), 2, "runs/mine.txt")  # the next eval deletes nothing of the user's there either
    assert (out / "runs" / "mine.txt").read_text() == "the user's, in runs/ after the eval"
    assert_intact(out, files)


def test_fix_never_writes_into_the_checkpoint_it_verifies(toy_factory, tmp_path):
    import shutil

    ckpt = tmp_path / "C"
    shutil.copytree(toy_factory("glm5", shard_size="300KB"), ckpt)
    before = tree(ckpt)
    shard = sorted(ckpt.glob("model-*.safetensors"))[0]
    (tmp_path / "link").symlink_to(ckpt)
    for target in (shard, ckpt / "config.fixed.json", tmp_path / "link" / "x.json", tmp_path / "C" / ".." / "C" / "y"):
        one_line(quant("verify-manifest", ckpt, "--fix", target, "--overwrite"), 2, "inside the checkpoint")
    assert tree(ckpt) == before


@pytest.mark.parametrize("command", [["toy", "glm5", "{out}"], ["demo", "{out}", "--limit", "2"],
                                     ["eval", "--candidate", "{src}", "--baseline", "{src2}", "--tasks", "toy_arith",
                                      "--limit", "2", "--out", "{out}"]])
def test_odd_output_names_are_exit_2(toy_factory, tmp_path, command):
    dangling, loop = tmp_path / "dangling", tmp_path / "loop"
    dangling.symlink_to(tmp_path / "nowhere")
    loop.symlink_to(loop)
    bad = os.fsencode(str(tmp_path)) + b"/out-\xff\xfe"
    for out, phrase in ((dangling, "symbolic link to nothing"), (loop, "loop of symbolic links"),
                        (bad, "not valid UTF-8")):
        args = [os.fsencode(a.format(out="{out}", src=toy_factory("qwen3-moe"), src2=toy_factory("deepseek-v3")))
                for a in command]
        args = [out if a == b"{out}" else a for a in args]
        result = subprocess.run([os.fsencode(sys.executable), b"-m", b"quant.cli", *map(os.fsencode, args)],
                                capture_output=True, timeout=600,
                                env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
        stderr = result.stderr.decode("utf-8", "replace")
        lines = stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and phrase in lines[0], stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "loop"]  # nothing written, no runs/ or tasks/


def test_toy_overwrite_over_an_export_of_ours_replaces_it_whole(toy_factory, tmp_path):
    out = tmp_path / "e"
    quantize_checkpoint(toy_factory("glm5", shard_size="300KB"), out, log=lambda m: None)
    (out / "mine.txt").write_text("a user's file")
    result = quant("toy", "qwen3-moe", out, "--overwrite")
    assert result.returncode == 0, result.stderr
    fresh = quant("toy", "qwen3-moe", tmp_path / "fresh")
    assert result.stdout.replace(str(out), "X") == fresh.stdout.replace(str(tmp_path / "fresh"), "X")
    assert {k: v for k, v in tree(out).items() if not k.startswith(".quant") and k != "mine.txt"} == \
        {k: v for k, v in tree(tmp_path / "fresh").items() if not k.startswith(".quant")}
    assert (out / "mine.txt").read_text() == "a user's file"


def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    return os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                                capture_output=True).returncode == 0


def test_eval_on_a_full_disk_is_exit_74_naming_the_path(tmp_path, arith_copy):
    mnt = tmp_path / "tiny"
    if not _tmpfs(mnt, "32k"):
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        result = quant("eval", "--candidate", TOY_ARITH, "--baseline", arith_copy, "--tasks", "toy_arith",
                       "--limit", "2", "--max-gen-toks", "4", "--seeds", "1", "--out", mnt / "out")
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]  # after eval's log
        assert result.returncode == 74 and len(errors) == 1 and str(mnt) in errors[0], result.stderr
        assert "No space left" in errors[0] and "Traceback" not in result.stderr
        assert not (mnt / "out" / "report.json").exists()
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_the_eval_report_lists_every_exit_code_of_the_table():
    from evals.report.render import METHODS

    for code in ("0 pass", "1 fail", "3 inconclusive", "4 invalid", "69 no verdict", "2 (bad input)", "74"):
        assert code in METHODS["exit_code"], code
