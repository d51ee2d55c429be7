"""An engine release is one file (issue #51 item 4): quant/manifests/engines/<engine>/<release>.yaml holds the
release's rules only, and adding a release is adding that file. A fake SGLang release written as data alone, in a
copy of the manifests, is checked by `quant verify-manifest --engine sglang==0.5.99` exactly as the release it
inherits and listed by `quant engines show`; every shipped release file is rules only, and every narrative pointer
it carries leads to its note in docs/engines/."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from quant import engines
from quant.engine_files import ENGINE_FILE, ENGINE_KEYS, INHERITS
from quant.engine_rules import EngineRules
from quant.paths import MANIFESTS_DIR
from synthetic import glm_moe_dsa_config, glm_moe_dsa_layout, quark_layout, write_checkpoint

REPO = Path(__file__).resolve().parent.parent
RULE_KEYS = {f for f in EngineRules.__dataclass_fields__}
FAKE = "0.5.99"


def _quant(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quant", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)


@pytest.fixture
def with_fake_release(tmp_path):
    """A copy of the package's manifests with sglang/0.5.99.yaml added, inheriting the newest profiled release."""
    manifests = tmp_path / "manifests"
    shutil.copytree(MANIFESTS_DIR, manifests)
    latest = engines.releases("sglang")[-1]
    (manifests / "engines" / "sglang" / f"{FAKE}.yaml").write_text(
        f'{INHERITS}: "{latest}"\nsources: ["a fake release, data only (tests/test_engine_release_files.py)"]\n')
    return manifests, latest


def test_a_release_added_as_one_file_is_verified_and_shown(with_fake_release, tmp_path):
    manifests, latest = with_fake_release
    cfg = glm_moe_dsa_config(3)
    tensors, config = quark_layout(cfg, glm_moe_dsa_layout(cfg))
    ckpt = write_checkpoint(tmp_path / "ckpt", config, tensors)
    env = {**os.environ, "QUANT_MANIFESTS_DIR": str(manifests)}

    new = _quant(env, "verify-manifest", str(ckpt), "--engine", f"sglang=={FAKE}", "--json")
    old = _quant(env, "verify-manifest", str(ckpt), "--engine", f"sglang=={latest}", "--json")
    assert new.returncode == old.returncode == 0, new.stderr
    new_data, old_data = json.loads(new.stdout), json.loads(old.stdout)
    assert new_data["profiles"] == [f"sglang=={FAKE}"]
    assert [(g["rule"], g["message"]) for g in new_data["groups"]] == \
        [(g["rule"], g["message"]) for g in old_data["groups"]]
    # `sglang==latest` is now the fake release: releases are ordered by their files' versions
    latest_run = _quant(env, "verify-manifest", str(ckpt), "--engine", "sglang==latest", "--json")
    assert json.loads(latest_run.stdout)["profiles"] == [f"sglang=={FAKE}"]

    shown = _quant(env, "engines", "show", "GlmMoeDsaForCausalLM", "--engine", "sglang", "--json")
    assert shown.returncode == 0, shown.stderr
    releases = json.loads(shown.stdout)["releases"]
    assert list(releases)[-2:] == [f"sglang=={latest}", f"sglang=={FAKE}"]
    fake, parent = releases[f"sglang=={FAKE}"]["rules"], releases[f"sglang=={latest}"]["rules"]
    assert {k: v for k, v in fake.items() if k != "sources"} == {k: v for k, v in parent.items() if k != "sources"}
    text = _quant(env, "engines", "show", "GlmMoeDsaForCausalLM", "--engine", f"sglang=={FAKE}")
    assert text.returncode == 0 and text.stdout.startswith(f"# sglang=={FAKE} (SGLang), GlmMoeDsaForCausalLM\n")


def test_a_release_file_with_an_unknown_key_is_one_line(with_fake_release):
    manifests, latest = with_fake_release
    fake = manifests / "engines" / "sglang" / f"{FAKE}.yaml"
    fake.write_text(f'{INHERITS}: "{latest}"\nmaps_exlcude: true\n')
    run = _quant({**os.environ, "QUANT_MANIFESTS_DIR": str(manifests)}, "engines", "show", "GlmMoeDsaForCausalLM")
    assert run.returncode != 0 and run.stdout == ""
    assert run.stderr.strip() == f"error: {fake}: maps_exlcude: unknown rule key; did you mean 'maps_exclude'?"


def test_show_reduces_the_rules_keyed_by_architecture():
    """`quant engines show ARCH`: a rule keyed by architecture shows ARCH's entry only, or is left out."""
    from typer.testing import CliRunner

    from quant.cli import app

    result = CliRunner().invoke(app, ["engines", "show", "KimiK3ForConditionalGeneration", "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)["releases"]
    assert list(shown) == [p.label for p in engines.all_profiles()]
    for p in engines.all_profiles():
        rules = shown[p.label]["rules"]
        assert ("name_mappers" in rules) == ("KimiK3ForConditionalGeneration" in p.rules.name_mappers)
    bad = CliRunner().invoke(app, ["engines", "show", "KimiK3ForConditionalGeneration", "--engine", "sglang==0.9"])
    assert bad.exit_code != 0


@pytest.mark.parametrize("label", [p.label for p in engines.all_profiles()])
def test_every_release_is_one_file_of_rules_only(label):
    engine, release = label.split("==")
    path = MANIFESTS_DIR / "engines" / engine / f"{release}.yaml"
    data = yaml.safe_load(path.read_text()) or {}
    assert set(data) <= RULE_KEYS | {INHERITS}, path
    engine_keys = set(yaml.safe_load((path.parent / ENGINE_FILE).read_text()))
    assert engine_keys <= RULE_KEYS | set(ENGINE_KEYS)


@pytest.mark.parametrize("engine", engines.engine_names())
def test_every_narrative_pointer_leads_to_its_note(engine):
    """A rule file's `# why: docs/engines/<engine>.md [tag]` names a note that exists (and each note is pointed
    at), so the reasoning moved out of the data stays one grep away from its rule."""
    folder = MANIFESTS_DIR / "engines" / engine
    pointers = [m.groups() for path in sorted(folder.glob("*.yaml"))
                for m in re.finditer(r"# why: (docs/engines/[\w.-]+\.md) \[([\w.-]+)\]", path.read_text())]
    assert pointers, folder
    notes = {}
    for doc in {d for d, _ in pointers}:
        notes[doc] = set(re.findall(r"^## \[([\w.-]+)\]", (REPO / doc).read_text(), re.M))
    assert sorted(tag for doc, tag in pointers if tag not in notes[doc]) == []
    assert sorted(set().union(*notes.values()) - {tag for _, tag in pointers}) == []
