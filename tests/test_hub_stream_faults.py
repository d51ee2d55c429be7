"""The faults of a streamed `quant quantize ORG/NAME OUT` that tests/test_hub_stream.py leaves: the disk filling
mid-run (OUT on a small tmpfs: a source download or an output shard that does not fit) is one line naming the
path, exit 74, with no half-written file in OUT and no config.json, and the same command finishes once there is
room; and a repository changed on the Hub between a failed run and its resume (a finished shard's source replaced)
has that shard made again, so the export is the new source's, byte for byte."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hub_server import HubServer, one_line

REPO = Path(__file__).resolve().parent.parent
SHARD = 200_000  # the toy's shard size: 17 source shards

# The slow tier (make test-slow, in CI): real processes and servers, each case seconds to a minute.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A qwen3-moe toy of 17 shards served as org/src, and its local export."""
    from quant.pipeline import quantize_checkpoint
    from quant.toy import build_toy

    tmp = tmp_path_factory.mktemp("faults")
    src = build_toy("qwen3-moe", tmp / "src", shard_size=SHARD, seed=0)
    quantize_checkpoint(src, tmp / "local", check_engines=[])
    server = HubServer().start()
    server.add_repo("org/src", src, content_sha=True)
    yield {"server": server, "src": src, "local": tmp / "local", "tmp": tmp}
    server.stop()


def quant(world, out, *args, wait=True, home=None):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    base.update({"HF_ENDPOINT": world["server"].url, "HF_HUB_OFFLINE": "0",
                 "HF_HOME": str(home or world["tmp"] / "hf_home")})
    cmd = [sys.executable, "-m", "quant.cli", "quantize", "org/src", str(out), "--no-progress", "--check-engines",
           "", *map(str, args)]
    if not wait:
        return subprocess.Popen(cmd, cwd=REPO, env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    r = subprocess.run(cmd, cwd=REPO, env=base, capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout, r.stderr


def same_export(local: Path, out: Path) -> None:
    shards = sorted(p.name for p in local.glob("*.safetensors"))
    assert shards == sorted(p.name for p in out.glob("*.safetensors"))
    for name in shards + ["model.safetensors.index.json", "config.json"]:
        assert (out / name).read_bytes() == (local / name).read_bytes(), name


def only_finished_shards(out: Path) -> int:
    """Every shard in OUT is a whole one its progress record vouches for; no config.json, no temporaries.
    Returns how many there are."""
    from quant.files import sha256_file

    assert not (out / "config.json").exists() and not (out / ".quant-tmp").exists()
    shards = sorted(out.glob("*.safetensors"))
    for shard in shards:
        record = json.loads((out / ".quant-progress" / (shard.name + ".json")).read_text())["result"]
        assert record["bytes"] == shard.stat().st_size and record["sha256"] == sha256_file(shard), shard.name
    return len(shards)


@pytest.fixture
def tmpfs(tmp_path):
    """A 1 MB tmpfs (the test's own mount; skipped where mounting is not allowed)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1000k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()[:80]})")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.parametrize("size", ["700k", "1000k"])
def test_disk_fills(world, tmpfs, size):
    """OUT on a tmpfs too small for the export (1.3 MB of it, plus the source shards in hand): a source download
    that cannot fit (refused before it starts; `.quant-source/`) or an output shard that fills the disk mid-write
    (`.quant-tmp/`), whichever comes first, is one line naming the path, exit 74; OUT holds only whole, recorded
    shards; with room made (the tmpfs grown) the same command finishes, byte-identical to the local export."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(tmpfs)], check=True)
    out = tmpfs / "out"
    world["server"].reset()
    line = one_line(*quant(world, out), 74)
    assert re.search(rf"error: {re.escape(str(out))}/\.quant-(source|tmp)/model-\S+: No space left on device",
                     line), line
    assert 0 < only_finished_shards(out) < 17
    subprocess.run(["mount", "-o", "remount,size=20m", str(tmpfs)], check=True)
    code, _, err = quant(world, out)
    assert code == 0 and "resuming:" in err, err
    same_export(world["local"], out)
    assert not (out / ".quant-source").exists()


def changed_copy(src: Path, dst: Path, shard: str) -> Path:
    """`src` with every weight of `shard` scaled by 2 (another source for that shard, the same headers)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(src / shard)
    save_file({n: t * 2 if t.is_floating_point() else t for n, t in tensors.items()}, dst / shard,
              metadata={"format": "pt"})
    return dst


def test_repo_changed_between_runs(world, tmp_path):
    """A run stopped by a lasting 503 after some shards; the repository then gets a new commit changing one of
    the finished shards' source; the same command makes that shard again (and only it of the finished ones): the
    export is the new source's local export, byte for byte."""
    from quant.pipeline import quantize_checkpoint

    server, out = world["server"], tmp_path / "out"
    server.reset()
    server.limit_rate(1_000_000)
    proc = quant(world, out, wait=False, home=tmp_path / "home")
    while len(list((out / ".quant-progress").glob("*.json"))) < 5 and proc.poll() is None:
        time.sleep(0.02)
    server.answer_status(503, retry_after=0, times=1000)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    finished = sorted(p.name[:-len(".json")] for p in (out / ".quant-progress").glob("*.json"))
    victim = finished[1]
    new_src = changed_copy(world["src"], tmp_path / "src2", victim)
    quantize_checkpoint(new_src, tmp_path / "local2", check_engines=[])
    server.add_repo("org/src", new_src, content_sha=True)  # a new commit of org/src
    server.reset()
    code, _, err = quant(world, out, home=tmp_path / "home")
    assert code == 0, err
    assert "the source changed since the earlier run: 1 finished shard(s)" in err and victim in err
    same_export(tmp_path / "local2", out)
    assert (out / victim).read_bytes() != (world["local"] / victim).read_bytes()
    manifest = json.loads((out / "quant_manifest.json").read_text())
    from quant.files import sha256_file

    assert manifest["source"]["shards"][victim]["sha256"] == sha256_file(new_src / victim)
    server.add_repo("org/src", world["src"], content_sha=True)  # the module's repository as it was
