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


def test_a_gptq_case_outside_the_tolerance_is_a_difference():
    """GPTQ cases are compared by agreement, not bytes: the comparison must still catch codes that moved beyond
    the tolerance, a scale two E8M0 steps off, a loss 5% apart and a structural manifest change."""
    from safetensors.torch import load_file

    cid, want = next((k, v) for k, v in GOLDEN["exports"].items() if "gptq" in v)
    reference = load_file(str(golden_exports.GPTQ_REFERENCES / f"{want['gptq']['tensors']}.safetensors"))
    codes = next(n for n in reference if not n.endswith("_scale"))
    scales = next(n for n in reference if n.endswith("_scale"))

    def verdict(edit, **changes):
        tensors = {k: v.clone() for k, v in reference.items()}
        edit(tensors)
        digest = golden_exports._tensors_digest(tensors)
        golden_exports._GPTQ_TENSORS[digest] = tensors
        got = {**want["gptq"], "tensors": digest[:16], **changes}
        return golden_exports.gptq_differences(cid, want["gptq"], got)

    assert verdict(lambda t: None) == []  # the reference itself
    total = sum(2 * t.numel() for n, t in reference.items() if not n.endswith("_scale"))

    def flip_codes(t, share):
        flat = t[codes].view(-1)
        n = min(flat.numel(), int(share * total) + 1)
        flat[:n] ^= 0x11  # both nibbles of each byte
    assert verdict(lambda t: flip_codes(t, 0.001)) == []  # within the tolerance
    assert any("codes agree" in d for d in verdict(lambda t: flip_codes(t, 0.03)))

    def two_steps(t):
        t[scales].view(-1)[0] = (int(t[scales].view(-1)[0]) + 2) % 255
    assert any("scale difference 2" in d for d in verdict(two_steps))
    assert any("calibration loss" in d for d in verdict(lambda t: None, loss=want["gptq"]["loss"] * 1.05))
    assert any("beyond its float figures" in d for d in verdict(lambda t: None, manifest="0" * 64))
