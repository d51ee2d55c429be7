"""Eval identity by content (issue #40 items 5 and 6): an in-process checkpoint is known by the sha256 of every
file's bytes (evals/arms/answers.py `checkpoint_digest`), never by a shard's size or modification time, so a shard
rewritten in place with its modification time put back reuses no kept answer; and a candidate compared with its own
model is refused by content, before any evaluation: a byte-identical copy as the baseline, or --baseline-run answers
its own model gave (the identity written beside them, runs/baseline/identity.json)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from evals.arms import answers
from evals.arms.answers import IDENTITY_FILE, checkpoint_digest, digests_for_this_run, same_model
from evals.compare import EvalRequest, evaluate
from quant.errors import QuantError

FIXTURE = Path(__file__).resolve().parent.parent / "evals" / "data" / "toy_arith" / "model"
SMALL = dict(tasks="toy_arith", limit=4, max_gen_toks=8, batch_size=4, mtp=False)


def rewrite_in_place(path: Path) -> None:
    """One bit of the file's last byte flipped in place (same inode, same size), its access and modification times
    put back as they were: what a size-and-mtime identity cannot see."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)


def other_model(dst: Path) -> Path:
    """The toy with another config (another model, as far as any identity goes)."""
    shutil.copytree(FIXTURE, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "rms_norm_eps": config["rms_norm_eps"] * 2}))
    return dst


def kept(lines: list[str], arm: str) -> int:
    found = [line for line in lines if line.startswith(f"{arm}: ") and "kept from an earlier run" in line]
    return int(found[0].split(": ")[1].split()[0]) if found else 0


# ----------------------------------------------------------------------------------------------- the digest


def test_a_shard_rewritten_in_place_with_its_mtime_put_back_is_another_checkpoint(tmp_path):
    copy = shutil.copytree(FIXTURE, tmp_path / "copy")
    digest = checkpoint_digest(copy)
    assert digest == checkpoint_digest(FIXTURE)  # the same bytes elsewhere: the same checkpoint
    rewrite_in_place(next(copy.glob("*.safetensors")))
    assert checkpoint_digest(copy) != digest


def test_a_checkpoint_is_hashed_once_per_run_and_again_in_the_next(tmp_path, monkeypatch):
    copy = shutil.copytree(FIXTURE, tmp_path / "copy")
    hashed = []
    real = answers.sha256_file
    monkeypatch.setattr(answers, "sha256_file", lambda p: hashed.append(Path(p).name) or real(p))
    files = len(list(copy.iterdir()))
    with digests_for_this_run():
        first = checkpoint_digest(copy)
        assert checkpoint_digest(copy) == checkpoint_digest(str(copy) + "/") == first
        assert len(hashed) == files  # one hash of each file in this run
        rewrite_in_place(next(copy.glob("*.safetensors")))  # within the run: its status change time moved
        assert checkpoint_digest(copy) != first and len(hashed) == 2 * files
    changed = checkpoint_digest(copy)
    assert len(hashed) == 3 * files  # the next run hashes every byte again, whatever the times say
    with digests_for_this_run():
        assert checkpoint_digest(copy) == changed and len(hashed) == 4 * files


@pytest.mark.slow
def test_no_kept_answer_is_reused_after_a_shard_is_rewritten_in_place(tmp_path):
    candidate = other_model(tmp_path / "candidate")
    out = tmp_path / "out"

    def run():
        lines = []
        evaluate(EvalRequest(candidate=str(candidate), baseline=str(FIXTURE), out=out, **SMALL), log=lines.append)
        return kept(lines, "baseline"), kept(lines, "candidate")

    assert run() == (0, 0)
    assert run() == (4, 4)
    rewrite_in_place(next(candidate.glob("*.safetensors")))  # its header, size and modification time unchanged
    assert run() == (4, 0)


# --------------------------------------------------------------------------------------- self-comparisons


def test_a_byte_identical_copy_as_the_baseline_is_refused_before_any_work(tmp_path):
    copy = shutil.copytree(FIXTURE, tmp_path / "copy")
    with pytest.raises(QuantError, match=r"are the same model \(byte-identical checkpoints, sha256 [0-9a-f]{16}\)") \
            as e:
        evaluate(EvalRequest(candidate=str(FIXTURE), baseline=str(copy), out=tmp_path / "out", **SMALL),
                 log=lambda m: None)
    assert e.value.exit_code == 2 and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_baseline_run_answers_of_the_candidates_own_model_are_refused(tmp_path):
    x = shutil.copytree(FIXTURE, tmp_path / "x")
    y = other_model(tmp_path / "y")
    first = tmp_path / "e1"
    evaluate(EvalRequest(candidate=str(y), baseline=str(x), out=first, **SMALL), log=lambda m: None)
    recorded = json.loads((first / "runs" / "baseline" / IDENTITY_FILE).read_text())
    assert recorded["kind"] == "transformers" and recorded["checkpoint_digest"] == checkpoint_digest(x)

    def refused(candidate, run, phrase):
        out = tmp_path / "refused"
        with pytest.raises(QuantError, match=phrase) as e:
            evaluate(EvalRequest(candidate=str(candidate), baseline_run=run, out=out, **SMALL), log=lambda m: None)
        assert e.value.exit_code == 2 and "\n" not in str(e.value) and str(run) in str(e.value)
        assert not out.exists()

    own = "its baseline answers were given by --candidate .* itself"
    refused(x, first, own + r".*the same checkpoint bytes")
    refused(FIXTURE, first, own + r".*the same checkpoint bytes")  # the same bytes under another path
    # Answers reused once are still the same model's: the identity travels with them.
    second = tmp_path / "e2"
    evaluate(EvalRequest(candidate=str(y), baseline_run=first, out=second, **SMALL), log=lambda m: None)
    assert json.loads((second / "runs" / "baseline" / IDENTITY_FILE).read_text()) == recorded
    refused(FIXTURE, second, own)
    # An output from before identities were written: known by its baseline's path.
    (first / "runs" / "baseline" / IDENTITY_FILE).unlink()
    refused(x, first, own + r".*the same path")


def test_same_model_by_content_and_for_servers_by_what_they_report():
    ckpt = {"kind": "transformers", "checkpoint_digest": "a" * 64, "dtype": "bfloat16"}
    assert same_model(ckpt, {**ckpt, "dtype": "float32", "batch_size": 1})
    assert not same_model(ckpt, {**ckpt, "checkpoint_digest": "b" * 64})
    server = {"kind": "server", "url": "http://h:1/v1/completions", "model": "m", "checkpoint_digest": "a" * 64}
    assert not same_model(ckpt, server)  # a checkpoint and an engine serving it: an engine check, allowed
    assert same_model(server, {**server, "url": "http://other:2/v1"})  # the same reported checkpoint
    assert not same_model(server, {**server, "checkpoint_digest": "b" * 64, "url": "http://h:1/v1"})
    named = {"kind": "server", "url": "http://h:1/v1/completions", "model": "m"}  # no digest: what the user names
    assert same_model(named, {**named, "url": "http://h:1/v1/chat/completions"})
    assert not same_model(named, {**named, "model": "n"})
    assert not same_model(named, {**named, "url": "http://h:2/v1"})
