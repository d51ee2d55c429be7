"""`quant push EXPORT ORG/NAME` against tests/hub_server.py with huggingface_hub's real upload client (in a
subprocess, HF_HUB_DISABLE_XET=1: the server speaks the Hub's LFS upload protocol, not its Xet storage): the
published files land byte for byte with the push's record (`.quant-push.json`), config.json in the last commit,
never the tool's scratch or a user's file; the card's base_model is the source's hub id (an @REVISION source too,
which the Hub's YAML check would refuse); a preflight failure, a changed or unfinished export, a target with a
revision and a token without write access each refuse in one line with nothing uploaded; a push killed mid-upload
commits nothing and the same command resumes, sending only the blobs the Hub lacks; one cut off between its two
commits resumes too, and so does one whose record landed before the card it replaces. A push never deletes or
replaces a file it did not write: a repository holding a user's files, a file edited on the Hub since the push,
another export's push, or the export's own source is refused in one line (exit 2) with every remote file as it was
and no write request sent."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hub_server import GITATTRIBUTES, HubServer

REPO = Path(__file__).resolve().parent.parent
RECORD = ".quant-push.json"


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


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_landed(world, repo_id: str, export: Path) -> None:
    """The repository holds the export's published files byte for byte, the Hub's `.gitattributes` as it made it,
    and the push's record naming the export's shards and each file sent; config.json came last."""
    repo = world["server"].repos[repo_id]
    names = published(export)
    assert sorted(set(repo.files) - {".gitattributes"}) == sorted([*names, RECORD])
    for name in names:
        assert repo.files[name].read_bytes() == (export / name).read_bytes(), name
    if ".gitattributes" in repo.files:
        assert repo.files[".gitattributes"].read_text() == GITATTRIBUTES
    record = json.loads(repo.files[RECORD].read_text())
    assert record["shards"] == {n: sha256(export / n) for n in names if n.endswith(".safetensors")}
    assert {n: e["sha256"] for n, e in record["files"].items()} == {n: sha256(export / n) for n in names}
    assert repo.commits[-1][2] == ["config.json"]  # config.json only once everything else is there
    assert "config.json" not in repo.commits[-2][2]


def snapshot(repo) -> dict[str, bytes]:
    """Every file the server's repository holds, with its bytes."""
    return {name: path.read_bytes() for name, path in repo.files.items()}


def assert_untouched(server, repo_id: str, before: dict[str, bytes], commits: int) -> None:
    """A refused push: no write request of any kind (create, YAML check, preupload, LFS, commit), every file of the
    repository as it was."""
    assert writes(server) == []
    assert snapshot(server.repos[repo_id]) == before and len(server.repos[repo_id].commits) == commits


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
    assert writes(server) == [] and len(server.repos["org/pushed"].commits) == commits


def test_push_over_another_exports_push_refused(world):
    """A repository holding an earlier push of another export (8 shards of other names than 17): refused in one
    line naming the repository and the record of that push, no write request, every remote file as it was; without
    that record (files uploaded by hand) it is refused as well, naming the first file the export does not have
    with those bytes."""
    server = world["server"]
    assert push(world, world["export"], "org/twice", "--private")[0] == 0
    assert server.repos["org/twice"].private  # created private
    repo = server.repos["org/twice"]
    before, commits = snapshot(repo), len(repo.commits)
    server.reset()
    line = one_line(*push(world, world["coarse"], "org/twice"), 2)
    assert "org/twice" in line and RECORD in line and "another export" in line and "nothing was uploaded" in line
    assert_untouched(server, "org/twice", before, commits)

    (repo.folder / RECORD).unlink()
    del repo.files[RECORD]
    before = snapshot(repo)
    coarse = world["coarse"]
    first = next(n for n in sorted(before) if n != ".gitattributes"
                 and not ((coarse / n).is_file() and (coarse / n).read_bytes() == before[n]))
    server.reset()
    line = one_line(*push(world, coarse, "org/twice"), 2)
    assert f"org/twice: not pushed, nothing was uploaded: it holds {first}," in line
    assert_untouched(server, "org/twice", before, commits)


def user_repo(server, tmp: Path, repo_id: str, files: dict[str, bytes]):
    folder = tmp / repo_id.replace("/", "--")
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return server.add_repo(repo_id, folder, content_sha=True)


@pytest.mark.parametrize("case", ["own-files", "foreign-weights", "export-and-a-file", "own-card"])
def test_users_repository_refused(world, tmp_path, case):
    """A repository holding files its owner wrote: their README.md, config.json and weights; weights of another
    name only (which the push would delete as an earlier export's); the export byte for byte plus a file of theirs;
    the export with their own model card. Each is refused in one line naming the repository and the first foreign
    file, exit 2, no write request, every remote file byte-identical."""
    export, server = world["export"], world["server"]
    theirs = {"README.md": b"---\nlicense: mit\n---\n# My model\n", "config.json": b'{"model_type": "mine"}\n',
              "model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{}      " + b"\x01" * 64}
    ours = {n: (export / n).read_bytes() for n in published(export)}
    files, first = {
        "own-files": (theirs, "README.md"),
        "foreign-weights": ({"weights-00001-of-00001.safetensors": theirs["model.safetensors"]},
                            "weights-00001-of-00001.safetensors"),
        "export-and-a-file": ({**ours, "LICENSE": b"MIT License\n"}, "LICENSE"),
        "own-card": ({**ours, "README.md": theirs["README.md"]}, "README.md"),
    }[case]
    repo_id = f"user/{case}"
    repo = user_repo(server, tmp_path, repo_id, files)
    before = snapshot(repo)
    assert before == files
    server.reset()
    line = one_line(*push(world, export, repo_id), 2)
    assert line.startswith(f"error: {repo_id}: not pushed, nothing was uploaded: it holds {first}, ")
    assert_untouched(server, repo_id, before, 0)


def test_push_to_its_source_refused(world):
    """The export quantized from org/src@v1 pushed to org/src (any case): refused in one line naming it as the
    source, before any request; the source's files as they were."""
    export, server = world["export"], world["server"]
    before = snapshot(server.repos["org/src"])
    server.reset()
    for target in ("org/src", "ORG/Src"):
        line = one_line(*push(world, export, target), 2)
        assert f"{target}: not pushed, nothing was uploaded" in line and "quantized from" in line
        assert "hf://org/src" in line
    assert server.stats.requests == 0
    assert snapshot(server.repos["org/src"]) == before and server.repos["org/src"].commits == []


def test_source_in_the_hub_cache_refused(tmp_path):
    """An export quantized from a directory of huggingface_hub's cache (models--ORG--NAME/snapshots/REV) names
    ORG/NAME as its source: a push there is refused; a local source of another layout names none."""
    from quant.errors import QuantError
    from quant.hub import HubRef
    from quant.pipeline.push import Export, refuse_source, source_repo

    export = Export(tmp_path, {})
    for ref, repo in (("/root/.cache/huggingface/hub/models--Org--Name.v2/snapshots/0123abc", "Org/Name.v2"),
                      ("hf://org/name@refs/pr/3", "org/name"), ("/data/models--x/snapshots", None),
                      ("/data/org/name", None)):
        (tmp_path / "quant_manifest.json").write_text(json.dumps({"source": {"checkpoint": ref}}))
        assert source_repo(export) == repo, ref
    (tmp_path / "quant_manifest.json").write_text(json.dumps({"source": {"checkpoint": "/hf/models--Org--Name/"
                                                                                       "snapshots/r"}}))
    with pytest.raises(QuantError, match="quantized from"):
        refuse_source(export, HubRef("org/name"))
    refuse_source(export, HubRef("org/other"))


def test_push_into_an_empty_repository(world):
    """A repository that exists but holds only the Hub's `.gitattributes` is pushed into, that file kept."""
    server = world["server"]
    server.create_repo("org/empty", gitattributes=True)
    code, _, err = push(world, world["export"], "org/empty")
    assert code == 0, err
    assert_landed(world, "org/empty", world["export"])
    assert len(server.repos["org/empty"].commits) == 2


def test_push_cut_off_between_commits_resumes(world, tmp_path):
    """The Hub failing the config.json commit: one line, exit 2, the repository holds the first commit and its
    record, no config.json; the same command resumes (no blob sent again) and lands the export. An edited card is
    then pushed over the earlier push's, and a file that push wrote but the export no longer has (named in its
    record) deleted with the first commit; a push whose record (carrying the earlier card) landed before its card
    goes on; a card edited on the Hub since is the owner's: refused, untouched."""
    server = world["server"]
    export = tmp_path / "export"
    shutil.copytree(world["export"], export, symlinks=True)
    server.reset()
    server.refuse_commits_adding("config.json")
    try:
        line = one_line(*push(world, export, "org/cut"), 2)
    finally:
        server.refuse_commits_adding(None)
    assert "org/cut" in line and "500" in line and "resumes" in line
    repo = server.repos["org/cut"]
    assert len(repo.commits) == 1 and RECORD in repo.commits[0][2] and "config.json" not in repo.files
    assert set(repo.files) == {".gitattributes", RECORD, *published(export)} - {"config.json"}
    server.reset()
    code, out, err = push(world, export, "org/cut")
    assert code == 0 and "pushed" in out, err
    assert uploads(server) == []
    assert_landed(world, "org/cut", export)

    card = export / "README.md"
    card.write_text(card.read_text() + "\nEdited after the first push.\n")
    record = json.loads(repo.files[RECORD].read_text())  # an earlier push of the export that wrote one more file
    record["files"]["eval_report.png"] = {"size": 3, "sha256": hashlib.sha256(b"png").hexdigest(),
                                          "git": hashlib.sha1(b"blob 3\0png").hexdigest()}
    (repo.folder / RECORD).write_text(json.dumps(record))
    (repo.folder / "eval_report.png").write_bytes(b"png")
    repo.files.update({"eval_report.png": repo.folder / "eval_report.png"})
    code, out, err = push(world, export, "org/cut")
    assert code == 0 and "was edited since the export" in err, err
    assert_landed(world, "org/cut", export)
    assert "eval_report.png" in repo.commits[-2][3]  # deleted with the first commit

    from quant.pipeline.push import finished_export, push_record  # a push whose record landed before its card
    earlier = json.loads(repo.files[RECORD].read_text())["files"]["README.md"]
    card.write_text(card.read_text() + "\nEdited once more.\n")
    (repo.folder / RECORD).write_text(json.dumps(push_record(finished_export(export), {"README.md": earlier})))
    code, out, err = push(world, export, "org/cut")
    assert code == 0 and "pushed" in out, err
    assert_landed(world, "org/cut", export)

    (repo.folder / "README.md").write_text(card.read_text() + "\nEdited on the Hub.\n")
    card.write_text(card.read_text() + "\nEdited again.\n")
    before, commits = snapshot(repo), len(repo.commits)
    server.reset()
    code, out, err = push(world, export, "org/cut")
    note, line = err.strip().splitlines()  # the note on the edited card, then the one error line
    assert code == 2 and out == "" and "was edited since the export" in note
    assert line.startswith("error: org/cut: not pushed, nothing was uploaded: it holds README.md, ")
    assert_untouched(server, "org/cut", before, commits)


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
    assert set(repo.files) == {".gitattributes"} and repo.commits == []
    lacking = blobs(export) - {oid for repo_id, oid in server.uploaded if repo_id == "org/killed"}
    assert 3 <= len(blobs(export)) - len(lacking) < len(blobs(export))
    server.reset()
    code, out, err = push(world, export, "org/killed")
    assert code == 0, err
    assert len(uploads(server)) == len(lacking)
    assert_landed(world, "org/killed", export)


def test_token_and_commit_message_as_hf_upload_takes_them(world, tmp_path):
    """Issue #50 item 6: `--token` (a token with write access, not HF_TOKEN's) and `--commit-message`."""
    server = world["server"]
    server.create_repo("me/by-token", writers=("writer-token",))
    code, _, err = push(world, world["export"], "me/by-token")  # HF_TOKEN=tok: no write access there
    assert code == 2 and "me/by-token" in err, err
    code, out, err = push(world, world["export"], "me/by-token", "--token", "writer-token", "--commit-message",
                          "GLM toy, MXFP4 experts")
    assert code == 0, err
    summaries = [summary for _, summary, _, _ in server.repos["me/by-token"].commits]
    assert summaries[-2:] == ["GLM toy, MXFP4 experts: weights, index, manifest, model card and side files",
                              "GLM toy, MXFP4 experts: config.json (the export is complete)"], summaries


@pytest.mark.slow
def test_revision_and_pull_request_as_hf_upload_takes_them(world, tmp_path):
    """Issue #50 item 6: `--revision BRANCH` lands the export on that branch (created from main, as `hf upload
    --revision` does) and leaves main as it was; `--create-pr` opens a pull request against main holding the export,
    main untouched; one cut off between its two commits names its refs/pr/N, and `--revision refs/pr/N` finishes it
    without sending a blob again. A branch holding a user's file is refused like main; both flags together, a
    refs/pr/N that does not exist and a malformed branch name are one line each, nothing written."""
    server, export = world["server"], world["export"]
    main_repo = server.create_repo("org/branched", gitattributes=True)
    (main_repo.folder / "notes.md").write_text("the owner's notes, on main")
    main_repo.files["notes.md"] = main_repo.folder / "notes.md"
    main_before, main_commits = snapshot(main_repo), len(main_repo.commits)

    code, out, err = push(world, export, "org/branched", "--revision", "mxfp4")
    assert code == 2 and "notes.md" in err, (code, out, err)  # the branch starts from main, which holds them
    code, out, err = push(world, export, "org/pushed-branch", "--revision", "mxfp4")
    assert code == 0 and "org/pushed-branch@mxfp4" in out, err
    repo = server.repos["org/pushed-branch"]
    assert set(repo.files) == {".gitattributes"} and repo.commits == []  # main: as the Hub made it
    branch = repo.refs["mxfp4"]
    assert sorted(set(branch.files) - {".gitattributes"}) == sorted([*published(export), RECORD])
    assert all(branch.files[n].read_bytes() == (export / n).read_bytes() for n in published(export))
    assert branch.commits[-1][2] == ["config.json"]
    code, out, err = push(world, export, "org/pushed-branch", "--revision", "mxfp4")
    assert code == 0 and "org/pushed-branch@mxfp4 already holds" in out, err
    code, out, err = quant(world, "verify-manifest", "org/pushed-branch@mxfp4")
    assert code == 0, out + err

    server.reset()
    server.refuse_commits_adding("config.json")
    try:
        line = one_line(*push(world, export, "org/pr", "--create-pr"), 2)
    finally:
        server.refuse_commits_adding(None)
    assert "refs/pr/1" in line and "--revision refs/pr/1" in line and "/discussions/1" in line, line
    repo = server.repos["org/pr"]
    assert set(repo.files) == {".gitattributes"} and repo.commits == []  # main untouched
    pr = repo.refs["refs/pr/1"]
    assert "config.json" not in pr.files and RECORD in pr.files
    server.reset()
    code, out, err = push(world, export, "org/pr", "--revision", "refs/pr/1")
    assert code == 0 and "org/pr@refs/pr/1" in out, err
    assert uploads(server) == []  # every blob already sent with the pull request's first commit
    assert sorted(set(pr.files) - {".gitattributes"}) == sorted([*published(export), RECORD])
    assert pr.commits[-1][2] == ["config.json"] and set(repo.refs) == {"refs/pr/1"}

    code, out, err = push(world, export, "org/pr", "--create-pr")
    assert code == 0 and "as pull request refs/pr/2" in out and "/discussions/2" in out, err
    assert set(repo.files) == {".gitattributes"} and repo.commits == []

    server.reset()
    for args, words in ((("--revision", "v2", "--create-pr"), "a pull request is opened against main"),
                        (("--revision", "refs/pr/9"), "has no pull request refs/pr/9"),
                        (("--revision", "a..b"), "not a branch name")):
        line = one_line(*push(world, export, "org/branched", *args), 2)
        assert words in line, line
    assert writes(server) == []
    assert snapshot(main_repo) == main_before and len(main_repo.commits) == main_commits
