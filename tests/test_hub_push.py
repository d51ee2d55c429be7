"""`quant push EXPORT ORG/NAME` against tests/hub_server.py with huggingface_hub's real upload client (in a
subprocess, HF_HUB_DISABLE_XET=1: the server speaks the Hub's LFS upload protocol, not its Xet storage): the
published files land byte for byte, config.json in the last commit, never the tool's scratch or a user's file; the
card's base_model is the source's hub id (an @REVISION source too, which the Hub's YAML check would refuse); a
preflight failure, a changed or unfinished export, a target with a revision and a token without write access each
refuse in one line with nothing uploaded; a push killed mid-upload commits nothing and the same command resumes,
sending only the blobs the Hub lacks."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hub_server import HubServer

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A qwen3-moe toy of 17 shards served as org/src (branch v1 too), its export quantized from the Hub at
    org/src@v1 (the streamed run), a weight-only MXFP4 export (vLLM only: SGLang's preflight fails it), and the
    export of the same toy in 8 shards."""
    from quant.pipeline import quantize_checkpoint
    from quant.toy import build_toy

    tmp = tmp_path_factory.mktemp("push")
    src = build_toy("qwen3-moe", tmp / "src", shard_size=200_000, seed=0)
    server = HubServer().start()
    server.add_repo("org/src", src, revisions=("main", "v1"), content_sha=True)
    w = {"server": server, "tmp": tmp, "home": tmp / "hf_home"}
    code, out, err = quant(w, "quantize", "org/src@v1", tmp / "export", "--no-progress")
    assert code == 0, err
    quantize_checkpoint(src, tmp / "weight-only", scheme="w_mxfp4", check_engines=[])
    coarse = build_toy("qwen3-moe", tmp / "src-coarse", shard_size=400_000, seed=0)
    quantize_checkpoint(coarse, tmp / "coarse", check_engines=[])
    yield {**w, "export": tmp / "export", "weight_only": tmp / "weight-only", "coarse": tmp / "coarse"}
    server.stop()


def quant(world, *args, wait=True, **env):
    """`python -m quant.cli ARGS` against the server with a token: (exit code, stdout, stderr), or the Popen."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    base.update({"HF_ENDPOINT": world["server"].url, "HF_HUB_OFFLINE": "0", "HF_HOME": str(world["home"]),
                 "HF_TOKEN": "tok", "HF_HUB_DISABLE_XET": "1", **env})
    cmd = [sys.executable, "-m", "quant.cli", *map(str, args)]
    if not wait:
        return subprocess.Popen(cmd, cwd=REPO, env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    r = subprocess.run(cmd, cwd=REPO, env=base, capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout, r.stderr


def push(world, export, repo, *args, **env):
    return quant(world, "push", export, repo, "--no-progress", *args, **env)


def one_line(code, out, err, expect):
    lines = err.strip().splitlines()
    assert code == expect and out == "" and len(lines) == 1 and lines[0].startswith("error: "), (code, out, err)
    return lines[0]


def published(export: Path) -> list[str]:
    """What a push must publish: the export's files, less the tool's bookkeeping and a user's notes."""
    return sorted(p.name for p in export.iterdir() if p.is_file() and not p.name.startswith(".")
                  and p.name != "notes.txt")


def uploads(server) -> list:
    return [e for e in server.stats.log if e[0] == "PUT"]


def writes(server) -> list:
    return [e for e in server.stats.log if e[0] in ("POST", "PUT")]


def blobs(export: Path) -> set[str]:
    """The sha256 of the export's shards (the LFS blobs a push sends; equal shards are one blob)."""
    return {hashlib.sha256((export / n).read_bytes()).hexdigest() for n in published(export)
            if n.endswith(".safetensors")}


def assert_landed(world, repo_id: str, export: Path) -> None:
    repo = world["server"].repos[repo_id]
    names = published(export)
    assert sorted(repo.files) == names
    for name in names:
        assert repo.files[name].read_bytes() == (export / name).read_bytes(), name
    assert repo.commits[-1][2] == ["config.json"]  # config.json only once everything else is there
    assert "config.json" not in repo.commits[-2][2]


def test_push_lands_byte_identical(world):
    """The export streamed from org/src@v1 lands on the server byte for byte, scratch and a user's file left
    behind; its card's base_model is org/src; the pushed repository passes verify-manifest read over HTTP; a second
    push finds it there and sends nothing."""
    export, server = world["export"], world["server"]
    (export / "notes.txt").write_text("a user's file beside the export")
    assert {".quant-owner.json", ".quant-complete", ".quant-progress"} <= {p.name for p in export.iterdir()}
    server.reset()
    fresh = blobs(export)
    code, out, err = push(world, export, "org/pushed")
    assert code == 0, err
    assert "pushed" in out and "org/pushed" in out
    assert_landed(world, "org/pushed", export)
    assert len(uploads(server)) == len(fresh) > 10  # each blob the Hub lacks, once
    card = server.repos["org/pushed"].files["README.md"].read_text()
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["base_model"] == "org/src"  # not org/src@v1
    assert "quant quantize org/src@v1" in card  # the reproduce command keeps the revision
    code, out, err = quant(world, "verify-manifest", "org/pushed")
    assert code == 0, out + err
    server.reset()
    commits = len(server.repos["org/pushed"].commits)
    code, out, err = push(world, export, "org/pushed")
    assert code == 0 and "nothing to push" in out, err
    assert uploads(server) == [] and len(server.repos["org/pushed"].commits) == commits


def test_push_over_an_earlier_export(world):
    """The same repository pushed an export of 17 shards, then one of 8 (other names): the second push's first
    commit deletes the earlier config.json, its last adds the new one and deletes the shards it does not have; the
    repository holds exactly the second export."""
    server = world["server"]
    assert push(world, world["export"], "org/twice", "--private")[0] == 0
    assert server.repos["org/twice"].private  # created private
    code, _, err = push(world, world["coarse"], "org/twice")
    assert code == 0, err
    assert_landed(world, "org/twice", world["coarse"])
    before, after = ({p.name for p in world[k].glob("*.safetensors")} for k in ("export", "coarse"))
    assert len(after) < len(before)
    first, last = server.repos["org/twice"].commits[-2:]
    assert first[3] == ["config.json"]  # the earlier config.json goes with the first commit
    assert sorted(last[3]) == sorted(before - after)


def test_refused_push_uploads_nothing(world):
    """A preflight error (SGLang cannot load weight-only MXFP4): one line, exit 1, not one request to the Hub;
    --force pushes it with a warning."""
    server = world["server"]
    server.reset()
    code, out, err = push(world, world["weight_only"], "org/refused", "--engine", "sglang")
    line = one_line(code, out, err, 1)
    assert "not pushed" in line and "--force" in line and "nothing was uploaded" in line
    assert server.stats.requests == 0 and "org/refused" not in server.repos
    code, out, err = push(world, world["weight_only"], "org/refused", "--engine", "sglang", "--force")
    assert code == 0 and "warning: pushing with 1 preflight error" in err, err
    assert_landed(world, "org/refused", world["weight_only"])


def test_changed_unfinished_or_misnamed_refused(world, tmp_path):
    """A shard changed since the export, an export without config.json, a target with @REVISION: one line, exit
    2, nothing sent."""
    server = world["server"]
    changed = tmp_path / "changed"
    shutil.copytree(world["export"], changed, symlinks=True)
    shard = sorted(changed.glob("*.safetensors"))[3]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    unfinished = tmp_path / "unfinished"
    shutil.copytree(world["export"], unfinished, symlinks=True)
    (unfinished / "config.json").unlink()
    server.reset()
    line = one_line(*push(world, changed, "org/x"), 2)
    assert shard.name in line and "changed" in line
    line = one_line(*push(world, unfinished, "org/x"), 2)
    assert "unfinished" in line
    line = one_line(*push(world, world["export"], "org/x@v2"), 2)
    assert "no @REVISION" in line
    assert server.stats.requests == 0


def test_push_without_write_access(world):
    """A repository the token may not write to, or no token at all: the Hub's 403 / 401 in one line, exit 2, no
    blob sent, no commit."""
    server = world["server"]
    server.create_repo("org/theirs", writers={"owner"})
    server.reset()
    line = one_line(*push(world, world["export"], "org/theirs"), 2)
    assert "403" in line and "write token" in line
    line = one_line(*push(world, world["export"], "org/theirs", HF_TOKEN=""), 2)
    assert "401" in line and "write token" in line
    assert uploads(server) == [] and server.repos["org/theirs"].commits == []


def test_storage_refusing_uploads(world):
    """The storage answering the blob uploads 403 mid-push: one line naming it, exit 2, nothing committed; once it
    takes them the same command lands the export."""
    server = world["server"]
    server.reset()
    server.refuse_puts()
    try:
        line = one_line(*push(world, world["export"], "org/refusing"), 2)
    finally:
        server.refuse_puts(False)
    assert "storage answered 403" in line and "PUT" in line and "resumes" in line
    assert server.repos["org/refusing"].commits == []
    code, _, err = push(world, world["export"], "org/refusing")
    assert code == 0, err
    assert_landed(world, "org/refusing", world["export"])


def test_killed_push_resumes(world):
    """SIGKILL while blobs are being uploaded: nothing committed (no file, no config.json on the Hub); the same
    command then sends only the blobs the Hub lacks and lands the same files."""
    export, server = world["export"], world["server"]
    server.reset()
    server.hold_puts_after(3)
    proc = push(world, export, "org/killed", wait=False)
    deadline = time.time() + 60
    while time.time() < deadline and len([e for e in uploads(server) if e[3] == 200]) < 3:
        time.sleep(0.02)
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    server.release_puts()
    time.sleep(0.5)  # the held requests end (a body cut off by the kill is never stored)
    repo = server.repos["org/killed"]
    assert repo.files == {} and repo.commits == []
    lacking = blobs(export) - {oid for repo_id, oid in server.uploaded if repo_id == "org/killed"}
    assert 3 <= len(blobs(export)) - len(lacking) < len(blobs(export))
    server.reset()
    code, out, err = push(world, export, "org/killed")
    assert code == 0, err
    assert len(uploads(server)) == len(lacking)
    assert_landed(world, "org/killed", export)
