"""Golden exports (issue #29): the exports of a subset of toy x scheme x recipe x method cases, and verify-manifest's
findings on the broken-export set, byte for byte what tests/data/golden_exports.json recorded. The full product is
`python scripts/golden_exports.py --check` (and `--record` after an intended change of the output)."""

from __future__ import annotations

import json

import pytest


def _script():
    from conftest import load_script

    return load_script("golden_exports")


golden_exports = _script()
GOLDEN = json.loads(golden_exports.GOLDEN.read_text())
SUBSET = golden_exports.subset(golden_exports.all_cases())
TOYS = list(dict.fromkeys(c["toy"] for c in SUBSET))


def test_the_subset_covers_every_toy_scheme_recipe_source_and_method():
    every = golden_exports.all_cases()
    for key in ("toy", "scheme", "recipe", "source", "method"):
        assert {c[key] for c in SUBSET} == {c[key] for c in every}, key
    assert {c["id"] for c in every} == set(GOLDEN["exports"])  # the recorded goldens are the cases of today


@pytest.mark.parametrize("toy", TOYS)
def test_exports_are_the_golden_bytes(toy, tmp_path):
    cases = [c for c in SUBSET if c["toy"] == toy]
    if not golden_exports.gptq_comparable():  # GPTQ's bytes are the recorded ISA's (scripts/golden_exports.py)
        cases = [c for c in cases if c["method"] != "gptq"]
    computed = golden_exports.compute(cases, tmp_path, broken=False, log=lambda m: None)
    assert golden_exports.differences(GOLDEN, computed) == []
    assert any("files" in r for r in computed["exports"].values())  # not every case of the toy refused


def test_verify_findings_on_the_broken_set_are_the_golden_ones(tmp_path):
    computed = golden_exports.broken_findings(tmp_path)
    assert set(computed) == set(GOLDEN["verify_broken"])
    for name, report in computed.items():
        assert report == GOLDEN["verify_broken"][name], name
    # each defect is found: findings beyond the clean export's (transformers' unquantized experts)
    clean = len(GOLDEN["verify_broken"]["clean"]["json"]["findings"])
    assert all(len(r["json"]["findings"]) > clean for n, r in GOLDEN["verify_broken"].items() if n != "clean")
