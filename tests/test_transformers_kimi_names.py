"""transformers builds Kimi-K2.5 under other names than the checkpoint's (issue #30): its kimi_k25 conversion renames
every module and splits the vision tower's fused wqkv into three linears, and Quark matches `exclude` against those
names. The engine rules model the renames as transformers build_prefixes; these tests hold that model to transformers'
own conversion code and show the preflight names the modules an export in the checkpoint's spelling leaves
unexcluded."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors import safe_open

from quant import engines
from quant.pipeline import quantize_checkpoint
from quant.toy import build_toy
from quant.verify import verify_checkpoint

conversion = pytest.importorskip("transformers.conversion_mapping")
loading = pytest.importorskip("transformers.core_model_loading")


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    out = tmp_path_factory.mktemp("kimi") / "toy"
    build_toy("kimi-k2.5", out)
    return out


def _transformers_names(modules: list[str]) -> dict[str, list[str]]:
    """What transformers' own conversion makes of each module (one name per Chunk target), the keys fed in sorted
    order as its loader does (a GroupWeightRename acts once its guard key was seen)."""
    transforms = conversion.get_checkpoint_conversion_mapping("kimi_k25")
    renamings = [t for t in transforms if isinstance(t, loading.WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, loading.WeightConverter)]
    out = {}
    for module in sorted(modules):
        key, pattern = loading.rename_source_key(module + ".weight", renamings, converters)
        key = key.removesuffix(".weight")
        targets = next(c for c in converters if pattern in c.source_patterns).target_patterns if pattern else [key]
        out[module] = [key.replace(targets[0], t) for t in targets] if pattern is None or len(targets) > 1 \
            else [module]
    return out


def test_the_modelled_names_are_transformers_own(toy):
    config = json.loads((toy / "config.json").read_text())
    with safe_open(str(next(toy.glob("*.safetensors"))), "pt") as f:
        linears = sorted({k.removesuffix(".weight") for k in f.keys()
                          if k.endswith(".weight") and len(f.get_slice(k).get_shape()) == 2
                          and ".experts." not in k and "embed" not in k and "norm" not in k
                          and "pos_emb" not in k})
    assert any(m.endswith(".wqkv") for m in linears) and any("language_model.model.layers" in m for m in linears)
    built = _transformers_names(linears)
    for module in linears:
        expected = [n for n in built[module] if n != module]
        aliases = engines.exclude_aliases(module, config)
        assert set(expected) <= set(aliases), (module, expected, aliases)


def test_an_export_excluding_checkpoint_names_only_is_flagged_for_transformers(toy, tmp_path):
    export = tmp_path / "export"
    quantize_checkpoint(toy, export, check_engines=None, log=lambda m: None)
    config = json.loads((export / "config.json").read_text())
    assert "model.vision_tower.layers.0.attn.v_proj" in config["quantization_config"]["exclude"]
    ours = {f.message for f in verify_checkpoint(export, engines=["transformers"]).errors
            if "vision_tower" in f.message or "mm_projector" in f.message}
    assert not ours  # the tower and projector stay BF16 and are excluded under transformers' names

    checkpoint_only = tmp_path / "checkpoint-only"
    shutil.copytree(export, checkpoint_only)
    config["quantization_config"]["exclude"] = [e for e in config["quantization_config"]["exclude"]
                                                if not e.startswith(("model.", "lm_head"))]
    (checkpoint_only / "config.json").write_text(json.dumps(config, indent=2))
    messages = " ".join(f.message for f in verify_checkpoint(checkpoint_only, engines=["transformers"]).errors)
    for built in ("model.vision_tower.layers.0.attn.q_proj", "model.vision_tower.layers.0.attn.v_proj",
                  "model.vision_tower.layers.0.mlp.fc2", "model.mm_projector.in_proj", " lm_head "):
        assert built in messages, built
