"""Defaults that agree (issue #42 item 5): by default `quant quantize`'s self-check and `quant verify-manifest` check
the same engine releases (every engine's default releases, the newest profiled one included, less those that cannot
read the model type), and on every toy's default export they name the same releases as refusing it: quantize
publishes an export its engines' newest releases load and names each older release that refuses it (the manifest's
`engines.refused_by`); verify-manifest reports exactly those releases' errors."""

from __future__ import annotations

import json

import pytest

from quant.engines import engine_names, profile, releases, select_profiles
from quant.toy import TOY_NAMES


def test_every_engine_checks_its_newest_profiled_release_by_default():
    for engine in engine_names():
        assert releases(engine)[-1] in [p.release for p in select_profiles([engine])], engine


@pytest.mark.parametrize("toy", TOY_NAMES)
def test_quantize_and_verify_manifest_agree_on_the_default_export(toy, toy_factory, tmp_path):
    from quant.pipeline import quantize_checkpoint
    from quant.verify import verify_checkpoint

    out = tmp_path / "out"
    notes = []
    quantize_checkpoint(toy_factory(toy), out, log=notes.append)
    engines = json.loads((out / "quant_manifest.json").read_text())["engines"]
    report = verify_checkpoint(out)
    assert engines["checked"] == report.profiles, toy
    failing = {f"{f.engine}=={v}" for f in report.errors for v in f.versions}
    assert set(engines["refused_by"]) == failing, toy
    assert all(not profile(*label.split("==")).release == releases(label.split("==")[0])[-1] for label in failing)
    assert [n for n in notes if n.startswith("note:") and "refuses this export" in n] == \
        [n for n in notes if n.startswith("note:") and any(label in n for label in failing)]


# Which profiled release cannot read which toy's model type. SGLang 0.5.12's four were run by the SGLang tier
# (tests_engines/cases.py SGLANG_CANNOT_BUILD: ServerArgs raises "model type ... but Transformers does not recognize
# this architecture"); the rest follow from the releases' wheels (scripts/release_parsing.py: the transformers each
# requires, its own config registry) and the first transformers release that knows each type.
CANNOT_READ = {
    "sglang==0.5.12": {"minimax-m3", "minimax-m3.1-flash", "kimi-k3", "glm5-next", "qwen4-exp", "deepseek-v4.1"},
    "sglang==0.5.19": {"glm5-next", "qwen4-exp", "deepseek-v4.1"},
    # no transformers release knows kimi_k3 or deepseek_v41 (engines register their own)
    "transformers==5.23": {"kimi-k3", "deepseek-v4.1"},
}


@pytest.mark.parametrize("toy", TOY_NAMES)
def test_a_release_that_cannot_read_the_model_type_is_a_named_failure(toy, toy_factory):
    from quant.engines import all_profiles
    from quant.verify import verify_checkpoint

    src = toy_factory(toy)
    for p in all_profiles():
        errors = [f for f in verify_checkpoint(src, engines=[p.label]).errors if f.tensor == "config.json:model_type"]
        assert bool(errors) == (toy in CANNOT_READ.get(p.label, set())), (toy, p.label, errors)
        if errors and "runs transformers" in errors[0].message:
            assert errors[0].fix.startswith("serve it with sglang==0.5.") and p.label not in errors[0].fix
    default = verify_checkpoint(src)  # the same releases are only named by default, never checked and failed
    assert not [f for f in default.errors if f.tensor == "config.json:model_type"]
    skipped = {f"{f.engine}=={v}" for f in default.findings if f.rule == "default releases" for v in f.versions}
    from quant.engines import serving_engines

    assert skipped == {label for label, toys in CANNOT_READ.items()
                       if toy in toys and label.split("==")[0] in serving_engines()}
