"""`quant quantize ORG/NAME OUT --max-disk SIZE` against a real HTTP server speaking the Hub's protocol
(tests/hub_server.py, huggingface_hub's own client in a subprocess): shards fetched on demand into OUT's own
`.quant-source/`, checked against the Hub's sha256, deleted once written, the disk limit kept at every moment; the
export byte-identical to quantizing a local copy; a kill resumes without refetching finished shards; every injected
fault (a dropped connection, 429/503 with Retry-After, corrupted bytes) ends in one line and the README's exit code
with nothing lost and nothing half-written published."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hub_server import DiskWatch, HubServer, one_line

REPO = Path(__file__).resolve().parent.parent
SHARD = 60_000  # the toy's shard size: 41 source shards of block FP8

# The slow tier (make test-slow, in CI): real processes and servers, each case seconds to a minute.
pytestmark = pytest.mark.slow


def scales_in_next_shard(src: Path, dst: Path) -> Path:
    """A copy of block-FP8 checkpoint `src` whose every `weight_scale_inv` is stored in the shard after its
    weight's (the last shard's in the first): each output shard needs two source shards, and each source shard
    stays needed until the shard before it is written."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir()
    index = json.loads((src / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    tensors = {f: load_file(src / f) for f in files}
    moved = {f: {} for f in files}
    for i, f in enumerate(files):
        for name in [n for n in tensors[f] if n.endswith("_scale_inv")]:
            moved[files[(i + 1) % len(files)]][name] = tensors[f].pop(name)
    weight_map = {}
    for f in files:
        save_file({**tensors[f], **moved[f]}, dst / f, metadata={"format": "pt"})
        weight_map.update({n: f for n in [*tensors[f], *moved[f]]})
    index["weight_map"] = dict(sorted(weight_map.items()))
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for p in src.iterdir():
        if p.is_file() and p.suffix != ".safetensors" and p.name != "model.safetensors.index.json":
            shutil.copy2(p, dst / p.name)
    return dst


@pytest.fixture(scope="module")
def world(tmp_path_factory, toy_factory):
    """A block-FP8 GLM-5 toy (six layers) of about 60 shards, its scales each in the next shard, served as org/toy (real sha256s),
    and its local export."""
    from quant.pipeline import quantize_checkpoint

    tmp = tmp_path_factory.mktemp("stream")
    from quant.toy import build_toy

    # six decoder layers (the toy has four): the source is then more than ten times the largest pair of shards an
    # output shard needs (the embedding's and the next), which sets the least --max-disk
    toy = build_toy("glm5", tmp / "toy", fp8_block=True, shard_size=SHARD, seed=0, overrides={"num_hidden_layers": 6})
    src = scales_in_next_shard(toy, tmp / "src")
    local = tmp / "local"
    quantize_checkpoint(src, local, check_engines=[])
    server = HubServer().start()
    server.add_repo("org/toy", src, content_sha=True)
    yield {"server": server, "src": src, "local": local, "tmp": tmp, "home": tmp / "hf_home"}
    server.stop()


def quant(world, *args, reset=True, wait=True, **env):
    """`python -m quant.cli quantize org/toy ARGS` against the server: (exit code, stdout, stderr), or the
    Popen when `wait` is False."""
    server = world["server"]
    if reset:
        server.reset()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    base.update({"HF_ENDPOINT": server.url, "HF_HUB_OFFLINE": "0", "HF_HOME": str(world["home"]), **env})
    cmd = [sys.executable, "-m", "quant.cli", "quantize", "org/toy", *map(str, args), "--no-progress",
           "--check-engines", ""]
    if not wait:
        return subprocess.Popen(cmd, cwd=REPO, env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    r = subprocess.run(cmd, cwd=REPO, env=base, capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout, r.stderr


def source_bytes(scratch: Path) -> int:
    """Bytes of source data under `.quant-source/`: shards, partial downloads and side files (not the few-byte
    download records)."""
    total = 0
    for base, _, names in os.walk(scratch):
        for name in names:
            p = Path(base) / name
            try:
                if p.suffix in (".safetensors", ".incomplete") or p.parent == scratch:
                    total += p.stat().st_size
            except OSError:  # deleted while we looked
                pass
    return total


def assert_same_export(world, out: Path) -> None:
    """Every shard, the index and config.json byte-identical to the local export; the manifest the same but for
    the source's name."""
    local = world["local"]
    shards = sorted(p.name for p in local.glob("*.safetensors"))
    assert shards == sorted(p.name for p in out.glob("*.safetensors"))
    for name in shards + ["model.safetensors.index.json", "config.json", "tokenizer.json"]:
        assert (out / name).read_bytes() == (local / name).read_bytes(), name
    a, b = (json.loads((d / "quant_manifest.json").read_text()) for d in (local, out))
    assert b["source"].pop("checkpoint") == "hf://org/toy"
    a["source"].pop("checkpoint")
    assert a == b
    assert not (out / ".quant-source").exists()


def downloads(world) -> list[tuple]:
    """The whole-file blob downloads the server answered since its last reset (header reads are ranges)."""
    return [e for e in world["server"].stats.log if e[0] == "GET" and e[1].startswith("/cdn/") and e[3] == 200]


def shard_names(world) -> list[str]:
    return sorted(p.name for p in world["src"].glob("*.safetensors"))


def required(world, tmp, *args) -> int:
    """The --max-disk the run asks for at least (from the refusal of a 1-byte limit)."""
    code, out, err = quant(world, tmp / "probe", "--max-disk", "1", *args)
    line = one_line(code, out, err, 2)
    assert "too small to stream org/toy" in line and not (tmp / "probe").exists()
    mb = float(line.split("needs ")[1].split(" MB")[0])
    return int(mb * 1e6) + 1000


def test_stream_bounded_disk_byte_identical(world, tmp_path):
    """A source more than ten times the limit streams within it (the limit is set by the largest shard, the
    toy's embedding, and the next shard holding its scales), and the export is the local one byte for byte; the source
    shards share their names with the outputs (auto-round#2021) and never stand in for them."""
    total = sum(p.stat().st_size for p in world["src"].glob("*.safetensors"))
    limit = required(world, tmp_path, "--look-ahead", "0")
    assert total > 10 * limit, (total, limit)
    out = tmp_path / "out"
    with DiskWatch(lambda: source_bytes(out / ".quant-source")) as watch:
        code, stdout, err = quant(world, out, "--max-disk", limit, "--look-ahead", "0")
    assert code == 0, err
    assert 0 < watch.peak <= limit, (watch.peak, limit)
    assert "peak source on disk" in err
    assert_same_export(world, out)
    src_names = {p.name for p in world["src"].glob("*.safetensors")}
    assert src_names == {p.name for p in out.glob("*.safetensors")}  # the same names (auto-round#2021's trap)
    manifest = json.loads((out / "quant_manifest.json").read_text())
    from quant.files import sha256_file

    for name in src_names:  # each output is the quantized shard, never the source of the same name
        assert sha256_file(out / name) == manifest["output"]["shards"][name]["sha256"]
        assert manifest["source"]["shards"][name]["sha256"] == sha256_file(world["src"] / name)
    assert sum((out / n).read_bytes() != (world["src"] / n).read_bytes() for n in src_names) > len(src_names) - 3
    blobs = downloads(world)
    assert len(blobs) == len(src_names)  # each shard fetched once
    assert set(manifest["source"]["shards"]) == src_names


def test_stream_equals_download_first(world, tmp_path):
    """Streaming and --no-stream (the whole repository first) write the same directory, model card included."""
    a, b = tmp_path / "stream", tmp_path / "whole"
    assert quant(world, a)[0] == 0
    # (its own HF_HOME: huggingface_hub copies a file its cache holds into a streamed run's directory instead of
    # fetching it, which would hide the other tests' faults)
    assert quant(world, b, "--no-stream", HF_HOME=str(tmp_path / "hf_home"))[0] == 0
    names = sorted(p.name for p in b.iterdir() if p.is_file() and not p.name.startswith(".quant-"))
    assert names == sorted(p.name for p in a.iterdir() if p.is_file() and not p.name.startswith(".quant-"))
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_kill_resumes_without_refetching(world, tmp_path):
    """SIGKILL on a slow link once a few shards are written; the same command finishes it, fetching only the
    source shards no finished output covers, to the same bytes."""
    out = tmp_path / "out"
    server = world["server"]
    server.reset()
    server.limit_rate(400_000)
    proc = quant(world, out, "--max-disk", "1GB", reset=False, wait=False)
    progress = out / ".quant-progress"
    deadline = time.time() + 120
    while time.time() < deadline and len(list(progress.glob("*.json"))) < 6:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(list(progress.glob("*.json")))
    n = len(shard_names(world))
    assert 6 <= done < n and not (out / "config.json").exists()
    code, _, err = quant(world, out)
    assert code == 0, err
    assert "resuming:" in err
    fetched = downloads(world)
    assert len(fetched) <= n - done + 1  # the scales of the first shard still to make live in the one before it
    assert_same_export(world, out)


@pytest.mark.parametrize("fault", ["drop", "429", "503"])
def test_transient_faults_recover(world, tmp_path, fault):
    """A connection dropped mid-shard (huggingface_hub resumes it with a range request), a 429 or a 503 with
    Retry-After (waited out): the run finishes, byte-identical."""
    server = world["server"]
    server.reset()
    if fault == "drop":
        server.drop_mid_blob(20_000, times=2)
    else:
        server.answer_status(int(fault), retry_after=1, times=2)
    out = tmp_path / "out"
    code, _, err = quant(world, out, "--max-disk", "1GB", reset=False)
    assert code == 0, err
    assert_same_export(world, out)


def test_lasting_503_stops_and_resumes(world, tmp_path):
    """The Hub answering 503 for good: one line naming the file, exit 2, no config.json, the finished shards kept;
    the same command later finishes the export."""
    server = world["server"]
    server.reset()
    out = tmp_path / "out"
    server.limit_rate(2_000_000)
    proc = quant(world, out, reset=False, wait=False)
    while len(list((out / ".quant-progress").glob("*.json"))) < 3 and proc.poll() is None:
        time.sleep(0.02)
    server.answer_status(503, retry_after=0, times=1000)
    _, err = proc.communicate(timeout=120)
    line = one_line(proc.returncode, "", err, 2)
    assert "503" in line and "org/toy" in line
    assert not (out / "config.json").exists() and not (out / ".quant-tmp").exists()
    assert len(list((out / ".quant-progress").glob("*.json"))) >= 3
    code, _, err = quant(world, out)
    assert code == 0 and "resuming:" in err, err
    assert_same_export(world, out)


def test_corrupt_shard_refused(world, tmp_path):
    """A shard whose bytes do not match the Hub's sha256 is never used: one line, exit 2, the bad copy deleted;
    once the Hub serves the right bytes the same command finishes."""
    server = world["server"]
    server.reset()
    bad = shard_names(world)[4]
    server.corrupt_file("org/toy", bad)
    out = tmp_path / "out"
    code, stdout, err = quant(world, out, reset=False)
    line = one_line(code, stdout, err, 2)
    assert bad in line and "sha256" in line
    assert not (out / "config.json").exists()
    assert not (out / ".quant-source" / bad).exists()
    assert not (out / ".quant-progress" / (bad + ".json")).exists()  # nor the shard before it (its scales)
    code, _, err = quant(world, out)
    assert code == 0, err
    assert_same_export(world, out)


def test_hub_gone_is_one_line(world, tmp_path):
    """Every connection to the storage dropped: one line with the network failure, exit 2."""
    server = world["server"]
    server.reset()
    server.fail_after(0)
    code, stdout, err = quant(world, tmp_path / "out", reset=False)
    line = one_line(code, stdout, err, 2)
    assert "network failure" in line or "org/toy" in line


def test_needs_follow_scales_across_shards(world):
    """The plan's view of the moved scales (quant/planning/needs.py): an output shard needs its own source shard
    and the next one (its weights' scales), the next one stays until both are written, and the disk a step needs
    counts both."""
    from quant.checkpoint import open_checkpoint
    from quant.planning.needs import SourceUse, required_disk
    from quant.planning.plan import make_plan
    from quant.planning.recipes import family_for_config, load_recipe
    from quant.planning.schemes import get_scheme

    ckpt = open_checkpoint(world["src"])
    family = family_for_config(ckpt.config, None)
    plan = make_plan(ckpt, family, load_recipe(None, family), get_scheme("w_mxfp4_a_mxfp4"), "even")
    files, use = ckpt.files, SourceUse.of(plan.shards)
    n = len(files)
    two = [i for i, needs in enumerate(use.needs) if len(needs) == 2]
    assert len(two) > n // 2
    for i in two:
        assert use.needs[i] == {files[i], files[(i + 1) % n]}
    sizes = {f: ckpt.file_size(f) for f in files}
    need, _ = required_disk(plan.shards, sizes, 1)
    assert need >= max(sizes[files[i]] + sizes[files[(i + 1) % n]] for i in two)
    assert required_disk(plan.shards, sizes, 2)[0] >= need
