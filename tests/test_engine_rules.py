"""The engine-rule schema (quant/engine_rules.py) and its files (quant/engine_files.py): every rule file under
manifests/engines/ is read into typed, frozen rules, and a key the schema does not declare, engine-wide, in a
release's overrides or inside a rule section, is rejected when the files are read, in one line naming the file, the
key path and the closest declared key (a misspelled rule left at its default would silently predict another
engine)."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from quant import engines
from quant.engine_rules import EngineRules, meanings
from quant.errors import QuantError


def _clear_caches() -> None:
    for cached in (engines.engine_files, engines.profile, engines.all_profiles, engines._renamers,
                   engines._unexpanded_shards):
        cached.cache_clear()


@pytest.fixture
def engine_files(tmp_path, monkeypatch):
    """Point quant.engines at an edited copy of the engine files: in file `name` (relative to manifests/engines/),
    (old, new) replacements, each found exactly once. Returns the edited file's path."""
    original = engines.ENGINES_DIR

    def write(name: str, *edits: tuple[str, str]):
        root = tmp_path / "engines"
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(original, root)
        path = root / name
        text = path.read_text()
        for old, new in edits:
            assert text.count(old) == 1, old
            text = text.replace(old, new)
        path.write_text(text)
        monkeypatch.setattr(engines, "ENGINES_DIR", root)
        _clear_caches()
        return path

    yield write
    monkeypatch.undo()
    _clear_caches()


def _load_error() -> str:
    with pytest.raises(QuantError) as e:
        engines.profile("sglang", "0.5.19")
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_misspelled_engine_wide_key_names_file_key_and_suggestion(engine_files):
    path = engine_files("sglang/engine.yaml", ("\nmaps_exclude: false\n", "\nmaps_exclud: false\n"))
    assert _load_error() == f"{path}: maps_exclud: unknown rule key; did you mean 'maps_exclude'?"


def test_a_misspelled_release_override_names_the_release_file(engine_files):
    path = engine_files("sglang/0.5.19.yaml", ("\nmaps_exclude: true ", "\nmaps_exlude: true "))
    assert _load_error() == f"{path}: maps_exlude: unknown rule key; did you mean 'maps_exclude'?"


def test_a_misspelled_key_inside_a_section(engine_files):
    path = engine_files("sglang/engine.yaml", ("  draft_naming: nextn ", "  draft_namig: nextn "))
    assert _load_error() == f"{path}: mtp.draft_namig: unknown rule key; did you mean 'draft_naming'?"
    engine_files("sglang/engine.yaml", ("      whole_layer_exclude: true\n", "      whole_layer_exclued: true\n"))
    assert ("mtp.draft_classes.DeepseekV3ForCausalLMNextN.whole_layer_exclued: unknown rule key; "
            "did you mean 'whole_layer_exclude'?") in _load_error()


def test_a_misspelled_engine_key_and_scheme_kind(engine_files):
    engine_files("sglang/engine.yaml", ('default_releases: ["0.5.12", "0.5.19", "0.5.23"]',
                                        'default_release: ["0.5.12", "0.5.19", "0.5.23"]'))
    assert "engine.yaml: default_release: unknown rule key; did you mean 'default_releases'?" in _load_error()
    engine_files("sglang/engine.yaml", ("    mxfp4: ok                          # _is_mx_fp4 -> QuarkW4A4MXFP4",
                                        "    mxf4: ok                          # _is_mx_fp4 -> QuarkW4A4MXFP4"))
    assert "engine.yaml: schemes.linear.mxf4: unknown rule key; did you mean 'mxfp4'?" in _load_error()


def test_a_value_of_the_wrong_type_or_outside_its_choices(engine_files):
    engine_files("sglang/engine.yaml", ("\nmaps_exclude: false\n", "\nmaps_exclude: 'no'\n"))
    assert "engine.yaml: maps_exclude: expected bool, got str" in _load_error()
    probe = "  config_probe: false                  # layer_quant"
    engine_files("sglang/engine.yaml",
                 (f"  coarse_exclude: unquantized\n{probe}", f"  coarse_exclude: unquantised\n{probe}"))
    assert ("engine.yaml: moe.coarse_exclude: 'unquantised' is not one of unquantized, assertion; did you mean "
            "'unquantized'?") in _load_error()


def test_a_release_file_inherits_a_release_or_names_its_problem(engine_files):
    """`inherits: <release>` starts a release from another's merged rules; a release that is not there, a cycle,
    a file not named by a version and an engine folder index.yaml does not list are each one line naming the file."""
    path = engine_files("sglang/0.5.19.yaml", ("config_schema: {exclude_required: false}\n",
                                               'inherits: "0.5.12"\n'))
    rules = engines.profile("sglang", "0.5.19").rules
    assert rules.config_schema.exclude_required  # 0.5.12's, not overridden here
    assert rules.maps_exclude and rules.transformers == "==5.12.1"  # 0.5.19's own overrides still win
    assert engines.profile("sglang", "0.5.12").rules.transformers == "==5.6.0"
    engine_files("sglang/0.5.19.yaml", ("config_schema: {exclude_required: false}\n", 'inherits: "0.5.7"\n'))
    assert _load_error() == f"{path}: inherits: no release '0.5.7' (releases: 0.5.12, 0.5.19, 0.5.23)"
    engine_files("sglang/0.5.19.yaml", ("config_schema: {exclude_required: false}\n", 'inherits: "0.5.19"\n'))
    assert _load_error() == f"{path}: inherits: a cycle (0.5.19 -> 0.5.19)"
    root = path.parent.parent
    (root / "sglang" / "latest.yaml").write_text("maps_exclude: true\n")
    _clear_caches()
    assert _load_error() == f"{root / 'sglang' / 'latest.yaml'}: a release file is named by its version (0.5.23.yaml)"
    (root / "sglang" / "latest.yaml").unlink()
    (root / "lmdeploy").mkdir()
    _clear_caches()
    assert _load_error() == f"{root / 'lmdeploy'}: an engine folder not listed in {root / 'index.yaml'}"


def test_the_shipped_file_loads_typed_and_every_key_has_a_meaning():
    for engine in engines.engine_names():
        for release in engines.releases(engine):
            rules = engines.profile(engine, release).rules
            assert isinstance(rules, EngineRules)
            with pytest.raises(dataclasses.FrozenInstanceError):
                rules.maps_exclude = True  # type: ignore[misc]
    assert all(meaning for meaning in meanings().values())
    assert engines.profile("sglang", "0.5.19").rules.mtp.draft_class["GlmMoeDsaForCausalLM"] == \
        "GlmMoeDsaForCausalLMNextN"  # a release override merged into the engine-wide mapping
    assert engines.profile("sglang", "0.5.12").rules.mtp.draft_class["GlmMoeDsaForCausalLM"] == \
        "DeepseekV3ForCausalLMNextN"


DEEPSEEK_MTP = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 3, "num_nextn_predict_layers": 2}
LEAF = "model.layers.3.mlp.experts.0.down_proj"


def test_the_draft_exclude_rules_are_data(engine_files):
    """SGLang's MTP naming, its coarse draft FusedMoE prefix and its first-NextN-layer-only draft are keys of
    sglang/engine.yaml's mtp (exclude_runtime_names, exclude_moe_coarse, draft_layers), not Python branches: editing the
    data changes the exclude entries the quantizer writes."""
    assert engines.exclude_aliases(LEAF, DEEPSEEK_MTP) == [
        LEAF, "model.decoder.mlp.experts.0.down_proj", "model.decoder.mlp.experts"]
    assert engines.exclude_aliases("model.layers.3.eh_proj", DEEPSEEK_MTP) == ["model.layers.3.eh_proj", "model.eh_proj"]
    assert engines.exclude_aliases("model.layers.3.embed_tokens", DEEPSEEK_MTP) == ["model.layers.3.embed_tokens"]
    second = "model.layers.4.mlp.experts.0.down_proj"
    assert engines.exclude_aliases(second, DEEPSEEK_MTP) == [second]  # SGLang builds only the first NextN layer

    engine_files("sglang/engine.yaml", ("  exclude_moe_coarse: true\n", "  exclude_moe_coarse: false\n"))
    assert engines.exclude_aliases(LEAF, DEEPSEEK_MTP) == [LEAF, "model.decoder.mlp.experts.0.down_proj"]
    engine_files("sglang/engine.yaml", ("  draft_layers: first ", "  draft_layers: all   "))
    assert engines.exclude_aliases(second, DEEPSEEK_MTP) == [
        second, "model.decoder.mlp.experts.0.down_proj", "model.decoder.mlp.experts"]
    engine_files("sglang/engine.yaml", ("  exclude_runtime_names: true\n",
                                        "  exclude_runtime_names: false\n"))
    assert engines.exclude_aliases(LEAF, DEEPSEEK_MTP) == [LEAF]
    engine_files("sglang/engine.yaml", ("  draft_layers: first ", "  draft_layers: firts "))
    assert "engine.yaml: mtp.draft_layers: 'firts' is not one of all, first; did you mean 'first'?" in _load_error()


def test_the_profile_answers_for_its_draft():
    sglang, vllm = engines.profile("sglang", "0.5.12"), engines.profile("vllm", "0.32")
    assert sglang.mtp_draft_name("model.layers.3.mlp.shared_experts.gate_proj", DEEPSEEK_MTP) == \
        "model.decoder.mlp.shared_experts.gate_proj"
    assert sglang.mtp_draft_name("model.layers.3.shared_head.head", DEEPSEEK_MTP) is None  # from the target model
    assert sglang.mtp_draft_name("model.layers.4.eh_proj", DEEPSEEK_MTP) is None  # not a layer its draft loads
    assert sglang.mtp_draft_name("model.layers.2.eh_proj", DEEPSEEK_MTP) is None  # not an MTP layer
    assert vllm.mtp_draft_name("model.layers.4.eh_proj", DEEPSEEK_MTP) == "model.layers.4.eh_proj"  # checkpoint names
    assert sglang.draft_exclude_names(LEAF, DEEPSEEK_MTP) == ["model.decoder.mlp.experts.0.down_proj",
                                                              "model.decoder.mlp.experts"]
    assert vllm.draft_exclude_names(LEAF, DEEPSEEK_MTP) == []
    assert sglang.draft_class(DEEPSEEK_MTP)[0] == "DeepseekV3ForCausalLMNextN"
    assert engines.serving_engines() == ("sglang", "vllm")
