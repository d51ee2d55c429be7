"""Benchmark `quant quantize ORG/NAME OUT` from the Hub: streaming (each shard fetched when needed, deleted once
written, `--max-disk`) against download-then-quantize (`--no-stream`: the whole repository first), on a toy
repository of tens of shards served by tests/hub_server.py on 127.0.0.1 with a bandwidth cap.

Both run as the user runs them (`python -m quant.cli quantize org/toy OUT`, HF_ENDPOINT pointing at the server, a
fresh HF_HOME each time). Reported per mode: wall time of the process, peak source bytes on disk (sampled every
2 ms under OUT/.quant-source for streaming; the HF cache for download-first, which holds the whole repository),
and for streaming the overlap ratio:

    overlap = (T_download-first - T_stream) / min(T_download, T_quantize)

where T_download is the download-first run's download (the whole repository at the cap) and T_quantize its
quantizing (the same command on the local copy): 1.0 means the shorter of the two phases is hidden entirely
behind the longer. Also the Hub preflight's requests and bytes (`quant verify-manifest org/toy`) against the
repository's size. The exports are compared byte for byte.

    .venv/bin/python scripts/bench_hub_stream.py [--work DIR] [--shard-size 60KB] [--rate-mb 1.0]
                                                 [--max-disk 400KB] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from hub_server import DiskWatch, HubServer  # noqa: E402

QUANT = [sys.executable, "-m", "quant.cli"]


def build_source(work: Path, shard_size: str) -> Path:
    """A BF16 GLM-5 toy (`quant toy glm5 --shard-size`), the repository served."""
    src = work / f"toy-glm5-{shard_size}"
    if not (src / "config.json").is_file():
        _run(QUANT + ["toy", "glm5", str(src), "--shard-size", shard_size, "--overwrite"], {})
    return src


def _run(cmd: list[str], env: dict, ok=(0,)) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True)
    if r.returncode not in ok:
        raise SystemExit(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()[-400:]}")
    return time.perf_counter() - t0, r


def tree_bytes(root: Path) -> int:
    """Bytes of the regular files under `root` (files deleted while it looks are skipped)."""
    total = 0
    for base, _, names in os.walk(root):
        for name in names:
            try:
                total += os.stat(os.path.join(base, name)).st_size
            except OSError:
                pass
    return total


def hub_env(server: HubServer, home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_ENDPOINT=server.url, HF_HUB_OFFLINE="0", HF_HOME=str(home), HF_HUB_DISABLE_PROGRESS_BARS="1")
    return env


def stream_once(server: HubServer, work: Path, i: int, max_disk: str) -> dict:
    out, home = work / f"stream-{i}", work / f"home-stream-{i}"
    with DiskWatch(lambda: tree_bytes(out / ".quant-source")) as disk:
        wall, r = _run(QUANT + ["quantize", "org/toy", str(out), "--max-disk", max_disk, "--no-progress",
                                "--check-engines", ""], hub_env(server, home))
    line = next(x for x in r.stderr.splitlines() if x.startswith("hub: fetched"))
    return {"wall_s": wall, "peak_disk": disk.peak, "line": line, "out": out}


def download_first_once(server: HubServer, work: Path, i: int) -> dict:
    """The whole repository downloaded (huggingface_hub's snapshot_download, as `--no-stream` does), then the same
    quantize on the local copy: the two phases timed apart, and together as `--no-stream` runs them."""
    home = work / f"home-whole-{i}"
    env = hub_env(server, home)
    fetch = ("from huggingface_hub import snapshot_download; from quant.planning.source import HUB_PATTERNS; "
             "print(snapshot_download('org/toy', allow_patterns=HUB_PATTERNS))")
    t_download, r = _run([sys.executable, "-c", fetch], env)
    local = Path(r.stdout.strip().splitlines()[-1])
    t_quantize, _ = _run(QUANT + ["quantize", str(local), str(work / f"local-{i}"), "--no-progress",
                                  "--check-engines", ""], env)
    out = work / f"whole-{i}"
    with DiskWatch(lambda: tree_bytes(home)) as disk:
        wall, _ = _run(QUANT + ["quantize", "org/toy", str(out), "--no-stream", "--no-progress",
                                "--check-engines", ""], hub_env(server, work / f"home-whole2-{i}"))
    cache = sum(p.stat().st_size for p in (work / f"home-whole2-{i}").rglob("*") if p.is_file())
    return {"wall_s": wall, "download_s": t_download, "quantize_s": t_quantize, "peak_disk": max(disk.peak, cache),
            "out": out}


def preflight(server: HubServer, work: Path) -> dict:
    # a BF16 source has findings (exit 1): only the traffic matters here
    _, r = _run(QUANT + ["verify-manifest", "org/toy", "--json"], hub_env(server, work / "home-preflight"), ok=(0, 1))
    return json.loads(r.stdout).get("hub", {}) if r.stdout.strip().startswith("{") else {}


def same_export(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir() if p.is_file() and not p.name.startswith(".quant-"))
    return names == sorted(p.name for p in b.iterdir() if p.is_file() and not p.name.startswith(".quant-")) and \
        all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--shard-size", default="60KB")
    ap.add_argument("--rate-mb", type=float, default=1.0, help="bandwidth cap of each blob download, MB/s")
    ap.add_argument("--max-disk", default="400KB")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-hub-stream-"))
    src = build_source(work, args.shard_size)
    shards = sorted(src.glob("*.safetensors"))
    total = sum(p.stat().st_size for p in shards)
    server = HubServer().start()
    server.add_repo("org/toy", src, content_sha=True)
    server.limit_rate(args.rate_mb * 1e6)
    try:
        streams = [stream_once(server, work, i, args.max_disk) for i in range(args.repeat)]
        wholes = [download_first_once(server, work, i) for i in range(args.repeat)]
        server.limit_rate(None)
        hub = preflight(server, work)
    finally:
        server.stop()
    report(args, src, shards, total, streams, wholes, hub)


def report(args, src, shards, total, streams, wholes, hub) -> None:
    med = statistics.median
    t_stream, t_whole = med(s["wall_s"] for s in streams), med(w["wall_s"] for w in wholes)
    t_dl, t_q = med(w["download_s"] for w in wholes), med(w["quantize_s"] for w in wholes)
    overlap = (t_whole - t_stream) / min(t_dl, t_q)
    print(f"repository: {src.name}, {len(shards)} shards, {total / 1e6:.2f} MB, served at {args.rate_mb} MB/s; "
          f"median of {args.repeat}")
    print(f"streaming (--max-disk {args.max_disk}): {t_stream:.2f} s, peak source on disk "
          f"{max(s['peak_disk'] for s in streams) / 1e6:.3f} MB  [{streams[0]['line']}]")
    print(f"download-then-quantize (--no-stream): {t_whole:.2f} s (download {t_dl:.2f} s + quantize {t_q:.2f} s "
          f"apart), peak source on disk {max(w['peak_disk'] for w in wholes) / 1e6:.3f} MB")
    print(f"speed-up {t_whole / t_stream:.2f}x; overlap ratio {overlap:.2f}")
    print(f"exports byte-identical: {all(same_export(s['out'], w['out']) for s, w in zip(streams, wholes))}")
    if hub:
        print(f"hub preflight: {hub.get('requests')} requests, {hub.get('bytes', 0) / 1e3:.1f} kB of "
              f"{hub.get('repo_bytes', 0) / 1e6:.2f} MB "
              f"({100 * hub.get('bytes', 0) / max(1, hub.get('repo_bytes', 1)):.2g}%)")


if __name__ == "__main__":
    main()
