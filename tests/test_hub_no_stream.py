"""`quant quantize ORG/NAME[@REV] OUT --no-stream` (and GPTQ, which downloads first) against a real HTTP server
speaking the Hub's protocol (tests/hub_server.py, huggingface_hub's own client in a subprocess): the repository at
the revision named, in the HF cache, every file checked against the Hub's sha256 before use (a flipped byte in a
cached blob is fetched anew, never quantized), `--max-disk` honoured, a full disk under HF_HOME exit 74."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hub_server import HubServer

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def world(tmp_path_factory, toy_factory):
    from quant.pipeline import quantize_checkpoint

    tmp = tmp_path_factory.mktemp("nostream")
    src = toy_factory("qwen3-moe", shard_size=400_000)
    local = tmp / "local"
    quantize_checkpoint(src, local, check_engines=[])
    server = HubServer().start()
    server.add_repo("org/toy", src, revisions=("main", "v1"), content_sha=True)
    yield {"server": server, "src": src, "local": local, "tmp": tmp}
    server.stop()


def quant(world, home: Path, *args, **env):
    server = world["server"]
    server.reset()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    base.update({"HF_ENDPOINT": server.url, "HF_HUB_OFFLINE": "0", "HF_HOME": str(home), **env})
    cmd = [sys.executable, "-m", "quant.cli", "quantize", *map(str, args), "--no-progress", "--check-engines", ""]
    r = subprocess.run(cmd, cwd=REPO, env=base, capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout, r.stderr


def same_shards(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.glob("*.safetensors"))
    return names == sorted(p.name for p in b.glob("*.safetensors")) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names)


def test_a_revision_downloads_first_and_gives_the_local_export(world, tmp_path):
    code, _, err = quant(world, tmp_path / "home", "org/toy@v1", tmp_path / "out", "--no-stream")
    assert code == 0, err
    assert same_shards(world["local"], tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / "quant_manifest.json").read_text())
    assert manifest["source"]["checkpoint"] == "hf://org/toy@v1"


def test_a_corrupt_cached_blob_is_fetched_again_never_quantized(world, tmp_path):
    home = tmp_path / "home"
    assert quant(world, home, "org/toy", tmp_path / "first", "--no-stream")[0] == 0
    blobs = sorted(p for p in home.rglob("blobs/*") if p.stat().st_size > 100_000)
    assert blobs
    victim = blobs[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    code, out, err = quant(world, home, "org/toy", tmp_path / "second", "--no-stream")
    assert code == 0, err
    assert "does not match the Hub's sha256" in out + err
    assert same_shards(world["local"], tmp_path / "second")
    manifest = json.loads((tmp_path / "second" / "quant_manifest.json").read_text())
    local = json.loads((world["local"] / "quant_manifest.json").read_text())
    assert manifest["source"]["shards"] == local["source"]["shards"]  # the sha256s of what the Hub holds


def test_a_corrupt_cached_blob_is_not_copied_into_a_streamed_run(world, tmp_path):
    """huggingface_hub fills a streamed run's scratch from HF_HOME's cache when the blob is there: a flipped byte in
    that blob failed the sha256 check, and the second try copied the same blob (exit 2, "run the same command
    again", forever). The second try now fetches from the Hub."""
    home = tmp_path / "home"
    assert quant(world, home, "org/toy", tmp_path / "first", "--no-stream")[0] == 0
    victim = sorted(p for p in home.rglob("blobs/*") if p.stat().st_size > 100_000)[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    code, _, err = quant(world, home, "org/toy", tmp_path / "second", "--max-disk", "20MB")
    assert code == 0, err
    assert same_shards(world["local"], tmp_path / "second")


def test_max_disk_is_honoured_without_streaming(world, tmp_path):
    code, out, err = quant(world, tmp_path / "home", "org/toy", tmp_path / "out", "--no-stream", "--max-disk", "1MB")
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "--max-disk" in lines[0] and "Hugging Face cache" in lines[0], err
    assert not (tmp_path / "out").exists() and not list((tmp_path / "home").rglob("*.safetensors"))


def test_a_full_disk_under_hf_home_is_exit_74_naming_the_path(world, tmp_path, full_disk):
    if full_disk is None:
        pytest.skip("no tmpfs can be mounted here (not root)")
    code, _, err = quant(world, full_disk, "org/toy", tmp_path / "out", "--no-stream")
    assert code == 74, err
    assert len([line for line in err.splitlines() if line.strip()]) == 1 and str(full_disk) in err, err
