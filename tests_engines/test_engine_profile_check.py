"""scripts/check_engine_profile.py against the installed releases (issue #42 item 4): each profile (manifests/engines/)
agrees with what its release's classes, registry and distribution say, and a profile entry edited wrong is a named
difference (exit 1). The checker runs in each release's tier venv (.venv-engines: vLLM 0.32.0; .venv-sglang: SGLang
0.5.23, and 0.5.12 put first on PYTHONPATH as tests_engines/cases.py does), whatever interpreter runs this file; a
venv that is missing is an error, never a skip."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests_engines.cases import SGLANG_RELEASES, SGLANG_VENV

ROOT = Path(__file__).resolve().parent.parent
CHECKER = ROOT / "scripts" / "check_engine_profile.py"
ENGINES_DIR = ROOT / "quant" / "manifests" / "engines"
ENGINES_VENV = Path(os.environ.get("ENGINES_VENV", ROOT / ".venv-engines"))


def check(spec: str, *args: str) -> subprocess.CompletedProcess:
    engine, _, version = spec.partition("==")
    venv = ENGINES_VENV if engine == "vllm" else SGLANG_VENV
    python = venv / "bin" / "python"
    assert python.exists(), f"{python} missing: run `make {venv.name}/.installed`"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    env.pop("SGLANG_USE_CPU_ENGINE", None)
    if engine == "sglang":
        env["PYTHONPATH"] = os.pathsep.join([str(venv / p) for p in SGLANG_RELEASES[version]] + [str(ROOT)])
    return subprocess.run([str(python), str(CHECKER), spec, *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)


@pytest.mark.parametrize("spec", ["vllm==0.32.0", "sglang==0.5.23", "sglang==0.5.12"])
def test_profile_agrees_with_release(spec):
    proc = check(spec)
    assert proc.returncode == 0 and "ok: " in proc.stdout, proc.stdout + proc.stderr[-3000:]


def _edited(tmp_path: Path, edits: list[tuple[str, str, str]]) -> Path:
    """A copy of the engine files with, in each (file, old, new), old replaced once (each old must be there once:
    the test must edit what it says it edits)."""
    root = tmp_path / "engines"
    shutil.copytree(ENGINES_DIR, root)
    for name, old, new in edits:
        text = (root / name).read_text()
        assert text.count(old) == 1, old
        (root / name).write_text(text.replace(old, new))
    return root


def test_wrong_vllm_entries_are_named(tmp_path):
    profiles = _edited(tmp_path, [
        ("vllm/engine.yaml", '"mm_projector.proj.0": "mm_projector.linear_1",',
         '"mm_projector.proj.0": "mm_projector.linear_9",'),
        ("vllm/engine.yaml", "  qkv_proj: [q_proj, k_proj, v_proj]\n", "  qkv_proj: [q_proj, k_proj]\n"),
        ("vllm/0.32.yaml", 'transformers: "<5.20.0,>=5.16.1"', 'transformers: "<5.19.0,>=5.16.1"'),
    ])
    proc = check("vllm==0.32.0", "--profiles", str(profiles))
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    for key in ("name_mappers.KimiK3ForConditionalGeneration", "packed_modules_mapping.qkv_proj", "transformers"):
        assert f"vllm==0.32: {key}:" in proc.stdout, proc.stdout


def test_wrong_sglang_entries_are_named(tmp_path):
    profiles = _edited(tmp_path, [
        ("sglang/0.5.23.yaml", 'MiniMaxM3SparseForCausalLM: {".block_sparse_moe.": ".mlp."}',
         'MiniMaxM3SparseForCausalLM: {".block_sparse_moe.": ".moe."}'),
        ("sglang/engine.yaml", "  in_proj_ba: [in_proj_b, in_proj_a]       # same mapping", "  in_proj_ba: [in_proj_b]"),
        ("sglang/0.5.23.yaml", 'transformers: "==5.19.0"', 'transformers: "==5.18.0"'),
    ])
    proc = check("sglang==0.5.23", "--profiles", str(profiles))
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    for key in ("name_mappers.MiniMaxM3SparseForCausalLM", "packed_modules_mapping.in_proj_ba", "transformers"):
        assert f"sglang==0.5.23: {key}:" in proc.stdout, proc.stdout
