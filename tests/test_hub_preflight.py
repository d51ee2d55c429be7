"""`quant verify-manifest ORG/NAME[@REVISION]` against a real HTTP server speaking the Hub's protocol
(tests/hub_server.py): the same findings as on the local copy, headers (and with --scales the scale bytes) only,
and one `error:` line with exit 2 for every way the Hub can fail or refuse.

The client runs as the user runs it, `python -m quant.cli` in a subprocess, with HF_ENDPOINT pointing at the
server (huggingface_hub reads it when it is imported) and an empty HF_HOME (no stored token)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from hub_server import HubServer

REPO = Path(__file__).resolve().parent.parent
TOKEN = "hf_granted"


def _copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".quant-*")))


def _zero_scale(ckpt: Path, name: str) -> None:
    """Set every E8M0 byte of scale tensor `name` to 0x00 in place (an expert calibration never reached)."""
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    path = ckpt / index["weight_map"][name]
    with open(path, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        begin, end = json.loads(f.read(n))[name]["data_offsets"]
        f.seek(8 + n + begin)
        f.write(bytes(end - begin))


@pytest.fixture(scope="module")
def world(tmp_path_factory, toy_factory):
    """Toy exports served as repositories: good (main and v1), broken (the MTP alias incident and an all-zero
    expert scale), torn (a shard missing, one cut short), gated, private, and a header-only export of large
    layers (920 MB of sparse shards) for the byte ratio."""
    from quant.pipeline import quantize_checkpoint
    from synthetic import glm_moe_dsa_config, glm_moe_dsa_layout, quark_layout, write_checkpoint

    tmp = tmp_path_factory.mktemp("hub")
    good = tmp / "good"
    quantize_checkpoint(toy_factory("glm5", shard_size=300_000), good)  # `quant toy glm5 --shard-size 300KB`

    broken = _copy(good, tmp / "broken")
    config = json.loads((broken / "config.json").read_text())
    q = config["quantization_config"]
    q["exclude"] = [e for e in q["exclude"] if not e.startswith(("model.decoder.", "model.eh_proj"))]
    (broken / "config.json").write_text(json.dumps(config, indent=2))
    _zero_scale(broken, "model.layers.1.mlp.experts.3.down_proj.weight_scale")

    torn = _copy(good, tmp / "torn")
    shards = sorted(torn.glob("model-*.safetensors"))
    shards[4].unlink()
    with open(shards[6], "r+b") as f:
        f.truncate(shards[6].stat().st_size - 10)

    cfg = glm_moe_dsa_config(4, hidden=2048, experts=64, moe_inter=1024, inter=4096, q_lora=512, kv_lora=256)
    tensors, qcfg = quark_layout(cfg, glm_moe_dsa_layout(cfg))
    large = write_checkpoint(tmp / "large", qcfg, tensors, shards=16)

    server = HubServer().start()
    server.add_repo("org/good", good, revisions=("main", "v1"))
    server.add_repo("org/broken", broken)
    server.add_repo("org/torn", torn)
    server.add_repo("org/large", large)
    server.add_repo("org/gated", good, gated=True, tokens={TOKEN})
    server.add_repo("org/broken-gated", broken, gated=True, tokens={TOKEN})
    server.add_repo("org/private", good, private=True, tokens={TOKEN})
    yield {"server": server, "home": tmp / "hf_home", "good": good, "broken": broken, "torn": torn}
    server.stop()


def cli(world, *args, token=None, fail_after=None, expire_after=None, reset=True, **env):
    """`python -m quant.cli verify-manifest ARGS` against the server: (exit code, stdout, stderr)."""
    server = world["server"]
    if reset:
        server.reset()
    if fail_after is not None:
        server.fail_after(fail_after)
    if expire_after is not None:
        server.expire_after(expire_after)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    base.update(HF_ENDPOINT=server.url, HF_HUB_OFFLINE="0", HF_HOME=str(world["home"]))
    if token:
        base["HF_TOKEN"] = token
    r = subprocess.run([sys.executable, "-m", "quant.cli", "verify-manifest", *args], cwd=REPO,
                       env={**base, **env}, capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout, r.stderr


def one_error(world, *args, **kw) -> str:
    code, out, err = cli(world, *args, **kw)
    assert code == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1, (code, out, err)
    return err


def local_json(path: Path, scales: bool = False) -> tuple[int, dict]:
    """What `verify-manifest PATH --json [--scales]` reports on the local copy."""
    from quant.verify import verify_checkpoint
    from quant.verify.scales import ScanStats, scan_scales

    report = verify_checkpoint(path)
    data = None
    if scales:
        stats = ScanStats()
        report.findings += scan_scales(path, stats=stats)
        data = {"tensors": stats.tensors, "bytes": stats.bytes, "shards": stats.files}
    out = report.to_json()
    if data:
        out["scales"] = data
    return report.exit_code, out


def same_findings(local: dict, remote: dict, local_root: Path, repo: str) -> None:
    """The remote report is the local one with the repository named where the directory was."""
    text = json.dumps({k: local[k] for k in ("findings", "groups", "errors", "warnings", "profiles")})
    assert json.loads(text.replace(str(local_root), repo)) == {k: remote[k] for k in json.loads(text)}


def blob_reads(server) -> list[tuple]:
    return [entry for entry in server.stats.log if entry[1].startswith("/cdn/")]


def header_bytes(ckpt: Path) -> int:
    return sum(8 + struct.unpack("<Q", p.read_bytes()[:8])[0] for p in ckpt.glob("*.safetensors"))


# ---- the same findings, from headers only ----------------------------------------------------------------

def test_good_export_same_findings_as_local_headers_only(world):
    code, out, err = cli(world, "org/good@v1", "--json")  # a branch: every read pinned to its commit
    remote = json.loads(out)
    local_code, local = local_json(world["good"])
    assert (code, err) == (local_code, "") and code == 0
    same_findings(local, remote, world["good"], "org/good@v1")
    server, hub = world["server"], remote["hub"]
    assert remote["checkpoint"] == "org/good@v1" and hub["revision"] == "v1"
    assert all(f"/resolve/{hub['commit']}/" in entry[1] for entry in server.stats.log if "/resolve/" in entry[1])
    assert (hub["requests"], hub["bytes"]) == (server.stats.requests, server.stats.bytes)  # counted right
    reads = blob_reads(server)
    shards = sorted(world["good"].glob("*.safetensors"))
    assert len(reads) == len(shards) and all(r[2] and r[2].startswith("bytes=0-") and r[3] == 206 for r in reads)
    assert sum(r[4] for r in reads) <= 1.5 * header_bytes(world["good"])  # the headers, not the weights
    assert not any(p.endswith(".safetensors") and m == "GET" and s == 200 for m, p, _, s, _ in server.stats.log)
    assert hub["bytes"] < 0.03 * hub["repo_bytes"]  # a 2 MB toy: about 1.5-2.5 %, config and index included


def test_broken_export_same_findings_and_scales_as_local(world):
    code, out, err = cli(world, "org/broken", "--scales", "--json")
    remote = json.loads(out)
    local_code, local = local_json(world["broken"], scales=True)
    assert code == local_code == 1 and err == ""
    same_findings(local, remote, world["broken"], "org/broken")
    rules = {f["rule"] for f in remote["findings"] if f["severity"] == "error"}
    assert any(r.startswith("mtp runtime names") for r in rules) and "scales: e8m0-zero" in rules, rules
    assert any("SGLang builds model.decoder.self_attn.o_proj as MXFP4" in f["message"] for f in remote["findings"])
    assert remote["scales"] == local["scales"] and remote["scales"]["tensors"] > 0
    # only the headers and the scale tensors' byte ranges were read, each from the storage origin (no token)
    server = world["server"]
    read = sum(r[4] for r in blob_reads(server))
    assert read <= 1.5 * header_bytes(world["broken"]) + remote["scales"]["bytes"]
    assert server.stats.auth_to_storage == 0


def test_expired_storage_urls_are_asked_again(world):
    """The storage URLs the Hub redirects to are signed and expire: a scan that outlives them asks the Hub
    again and finds the same. A gated repository read with a token that has access: the token goes to the Hub,
    never to the storage."""
    shards = len(list(world["broken"].glob("*.safetensors")))
    code, out, err = cli(world, "org/broken-gated", "--scales", "--json", token=TOKEN, expire_after=shards + 3)
    assert code == 1 and err == ""
    _, local = local_json(world["broken"], scales=True)
    same_findings(local, json.loads(out), world["broken"], "org/broken-gated")
    server = world["server"]
    assert any(entry[3] == 403 for entry in blob_reads(server)) and server.stats.auth_to_storage == 0


def test_torn_export_same_integrity_findings_as_local(world):
    code, out, err = cli(world, "org/torn", "--json")
    local_code, local = local_json(world["torn"])
    remote = json.loads(out)
    assert code == local_code and err == ""
    same_findings(local, remote, world["torn"], "org/torn")
    kinds = {f["rule"] for f in remote["findings"]}
    assert {"integrity: missing-file", "integrity: corrupt-shard"} <= kinds, kinds
    corrupt = next(f for f in remote["findings"] if f["rule"] == "integrity: corrupt-shard")
    assert corrupt["message"].startswith("org/torn/model-") and "file not fully covered" in corrupt["message"]


def test_large_repo_headers_under_one_percent(world):
    code, out, err = cli(world, "org/large", "--json")
    hub = json.loads(out)["hub"]
    assert code in (0, 1) and err == ""
    assert hub["repo_bytes"] > 900e6 and hub["bytes"] < 0.001 * hub["repo_bytes"], hub  # about 0.02 %
    assert len(blob_reads(world["server"])) == 16  # one range request per shard


# ---- one line and exit 2 ------------------------------------------------------------------------------------

def test_every_refusal_is_one_line(world):
    import socket
    from concurrent.futures import ThreadPoolExecutor

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{s.getsockname()[1]}"
    cases = {  # independent: run side by side
        "revision": (("org/good@nope",), {}),
        "404": (("org/nothing",), {"token": TOKEN}),
        "private": (("org/private",), {}),
        "gated 401": (("org/gated",), {}),
        "gated 403": (("org/gated",), {"token": "hf_other"}),
        "down": (("org/good",), {"HF_ENDPOINT": down}),
        "offline": (("org/good",), {"HF_HUB_OFFLINE": "1"}),
    }
    with ThreadPoolExecutor(4) as pool:
        futures = {k: pool.submit(one_error, world, *args, reset=False, **kw) for k, (args, kw) in cases.items()}
        err = {k: f.result() for k, f in futures.items()}
    assert "org/good@nope: the repository org/good has no revision 'nope'" in err["revision"]
    assert "no model repository org/nothing on http://127.0.0.1" in err["404"] and "HTTP 404" in err["404"]
    assert "HF_TOKEN has no access" in err["404"]
    # a private repository without a token: the Hub answers 401 as for a missing one
    assert "no model repository org/private" in err["private"] and "HTTP 401" in err["private"]
    assert "no token was sent" in err["private"]
    assert "a gated repository and no token was sent (401)" in err["gated 401"] and "set HF_TOKEN" in err["gated 401"]
    assert "the token's account has no access (403)" in err["gated 403"]
    assert f"network failure from {down}" in err["down"] and "Connection refused" in err["down"]
    assert "the Hub is offline (HF_HUB_OFFLINE=1)" in err["offline"]


def test_network_failure_midway(world):
    # every header is read, then the connection drops during the scale reads
    shards = len(list(world["broken"].glob("*.safetensors")))
    err = one_error(world, "org/broken", "--scales", fail_after=shards + 2)
    assert err.startswith("error: org/broken: network failure reading model-") and "Server disconnected" in err


# ---- the pieces ---------------------------------------------------------------------------------------------

def test_hub_reference(tmp_path, monkeypatch):
    from quant.hub import HubRef, hub_reference

    monkeypatch.chdir(tmp_path)
    assert hub_reference("org/name") == HubRef("org/name")
    assert hub_reference("org/name@refs/pr/3") == HubRef("org/name", "refs/pr/3")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert hub_reference("org/name") is None  # a local path wins
    for text in ("name", "a/b/c", "/abs/path", "org/../x", "org/na me", "-org/x"):
        assert hub_reference(text) is None, text


def test_header_parser_agrees_with_safetensors(tmp_path, world):
    """parse_header refuses what the safetensors library refuses, in its words (corrupt-shard findings read the
    same on the Hub as on a local copy)."""
    from quant.checkpoint import read_shard_header
    from quant.hub import parse_header

    data = next(world["good"].glob("*.safetensors")).read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    first = min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])

    def with_header(h: dict) -> bytes:
        blob = json.dumps(h).encode()
        blob += b" " * (-len(blob) % 8)
        return struct.pack("<Q", len(blob)) + blob + data[8 + n:]

    cases = {
        "intact": data, "cut": data[:-7], "longer": data + b"xx", "tiny": data[:5], "empty": b"",
        "huge": struct.pack("<Q", 10 ** 9) + data[8:], "past end": struct.pack("<Q", len(data)) + data[8:],
        "shape": with_header({**header, first: {**header[first], "shape": [1, 2, 3]}}),
        "gap": with_header({**header, first: {**header[first], "data_offsets": [
            header[first]["data_offsets"][0] + 1, header[first]["data_offsets"][1]]}}),
    }
    for label, blob in cases.items():
        path = tmp_path / f"{label}.safetensors"
        path.write_bytes(blob)
        try:
            expected = read_shard_header(path)
        except Exception as e:
            expected = str(e).splitlines()[0]
        try:
            got = parse_header(blob, len(blob))[0]
        except ValueError as e:
            got = str(e)
        if isinstance(expected, str):
            assert isinstance(got, str) and got.split(":")[0] == expected.split(":")[0], (label, got, expected)
            if label in ("cut", "longer", "tiny", "empty", "huge", "shape"):
                assert got == expected, (label, got, expected)
        else:
            assert got == expected and list(got) == list(expected), label


def test_a_cached_config_that_is_not_the_hubs_is_fetched_again(world, tmp_path):
    """The HF cache is not trusted by name: a config.json edited in the cache (the MTP aliases removed, as in the
    incident) is checked against the Hub's git blob id and fetched anew, so the preflight reads the Hub's bytes."""
    home = tmp_path / "home"
    code, out, _ = cli(world, "org/good", "--json", HF_HOME=str(home))
    assert code == 0
    cached = [p for p in home.rglob("snapshots/*/config.json")]
    assert len(cached) == 1
    blob = cached[0].resolve()
    config = json.loads(blob.read_text())
    config["quantization_config"]["exclude"] = []
    blob.write_text(json.dumps(config))
    code, again, _ = cli(world, "org/good", "--json", HF_HOME=str(home))
    assert code == 0 and json.loads(again)["findings"] == json.loads(out)["findings"]
    assert json.loads(cached[0].read_text())["quantization_config"]["exclude"]  # the Hub's bytes again
