"""Every toy through the Hub (issue #49 item 3): each of the 16 families, sharded and served by tests/hub_server.py
(huggingface_hub's own client, in a subprocess), preflighted as a source and as an export, quantized streamed and
with --no-stream, gives the verdict and the bytes of its local copy: every output shard and every sidecar file (a
draft beside the shards included) byte-identical, config.json identical, the same findings.

One subprocess per family runs all of it (tests/hub_family_run.py), so the suite pays huggingface_hub's import once
per family."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hub_server import HubServer
from quant.pipeline import quantize_checkpoint
from quant.toy import TOY_NAMES
from quant.verify import verify_checkpoint

REPO = Path(__file__).resolve().parent.parent
RUNNER = Path(__file__).resolve().parent / "hub_family_run.py"

# The slow tier (make test-slow, in CI): a real server and a subprocess per family, ~5 s each.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    hub = HubServer().start()
    yield hub
    hub.stop()


def findings(report: dict, root: str) -> list:
    """The findings as comparable rows: the checkpoint's location replaced, so a local and a Hub copy compare."""
    return sorted(json.loads(json.dumps(report["findings"]).replace(root, "<ckpt>")), key=json.dumps)


def outputs(path: Path) -> dict[str, bytes]:
    """What an export's loaders read: its safetensors files (shards and sidecar files) and config.json."""
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())
            if p.suffix == ".safetensors" or p.name in ("config.json", "model.safetensors.index.json")}


@pytest.mark.parametrize("toy", TOY_NAMES)
def test_a_family_through_the_hub_is_its_local_copy(server, toy_factory, tmp_path, toy):
    src = toy_factory(toy, shard_size=300_000)
    local = tmp_path / "local"
    quantize_checkpoint(src, local, check_engines=[], log=lambda *a: None)
    server.add_repo(f"org/{toy}", src, content_sha=True)
    server.add_repo(f"org/{toy}-mx", local, content_sha=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_ENDPOINT=server.url, HF_HUB_OFFLINE="0", HF_HOME=str(tmp_path / "home"), HF_HUB_DISABLE_XET="1")
    run = subprocess.run([sys.executable, str(RUNNER), f"org/{toy}", str(tmp_path)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    hub = json.loads(run.stdout.splitlines()[-1])

    for way in ("streamed", "no-stream"):
        assert outputs(tmp_path / way) == outputs(local), f"{toy} {way}: not the local export's bytes"
    assert hub["streamed_source"] == f"hf://org/{toy}"
    expected_src = verify_checkpoint(src).to_json()
    expected_out = verify_checkpoint(local).to_json()
    assert hub["source"]["exit"] == verify_checkpoint(src).exit_code
    assert hub["export"]["exit"] == verify_checkpoint(local).exit_code
    assert findings(hub["source"]["report"], f"org/{toy}") == findings(expected_src, str(src))
    assert findings(hub["export"]["report"], f"org/{toy}-mx") == findings(expected_out, str(local))
    assert hub["scale_scan_bytes"] == quantize_checkpoint(src, tmp_path / "again", check_engines=[],
                                                          log=lambda *a: None)["timing"]["scale_scan_bytes"]
