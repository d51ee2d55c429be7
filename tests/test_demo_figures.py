"""The Quick start's figures are what `quant demo` prints: the demo runs (in `make test-slow`) and its report's
accuracies, interval, discordant count, verdict and decisive question count are read back from README.md."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parent.parent / "README.md"


def _quick_start_figures() -> dict:
    text = README.read_text()
    text = " ".join(text[text.index("## Quick start"):text.index("## Installing")].split())
    m = re.search(r"the FP8 baseline scores ([\d.]+)% and the MXFP4 candidate ([\d.]+)% \((\d+) discordant answers.*?"
                  r"\[([+-][\d.]+), ([+-][\d.]+)\] points and the verdict at the ([\d.]+)-point margin is (\w+) "
                  r"\((\d+) questions", text)
    assert m, "README's Quick start no longer states the demo's figures in the form this test reads"
    keys = ("baseline", "candidate", "discordant", "ci_low", "ci_high", "margin", "verdict", "n_to_pass")
    return dict(zip(keys, m.groups()))


def _isas() -> list[str | None]:
    """The machine's own ISA (None: no ATEN_CPU_CAPABILITY) last, after each vector ISA this CPU can run: in this order,
    through one inductor and kernel cache, the demo once aborted (issue #48: kernels compiled under avx2 served to a
    default-ISA AVX-512 process)."""
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    found = [isa for isa, flag in (("avx2", " avx2"), ("avx512", " avx512bw")) if flag in flags]
    return [*found, "default", None] if found else [None]


@pytest.fixture(scope="module")
def shared_caches(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo-caches")
    return {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "QUANT_CACHE_DIR": str(root / "kernels")}


@pytest.mark.parametrize("isa", _isas(), ids=lambda isa: isa or "machine-default")
def test_the_quick_start_figures_are_what_the_demo_prints(isa, shared_caches, tmp_path):
    """As a user runs it (no variable set), and under each ATEN_CPU_CAPABILITY: the demo evaluates in float64, so
    its figures are the README's on every CPU."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env.update(shared_caches, **({"ATEN_CPU_CAPABILITY": isa} if isa else {}))
    proc = subprocess.run([sys.executable, "-m", "quant.cli", "demo", str(tmp_path / "demo")], capture_output=True,
                          text=True, timeout=1800, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "demo" / "report" / "report.json").read_text())
    c = next(r for r in report["rows"] if r["primary"])["comparison"]
    want = _quick_start_figures()
    got = {"baseline": f"{100 * c['baseline_accuracy']:.1f}", "candidate": f"{100 * c['candidate_accuracy']:.1f}",
           "discordant": str(c["baseline_only_correct"] + c["candidate_only_correct"]),
           "ci_low": f"{100 * c['ci_low']:+.1f}", "ci_high": f"{100 * c['ci_high']:+.1f}",
           "margin": f"{100 * c['margin']:g}", "verdict": report["verdict"], "n_to_pass": str(c["n_to_pass"])}
    assert got == want
