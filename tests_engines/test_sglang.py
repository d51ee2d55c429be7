"""The SGLang tier (`make test-engines`; the fast slice `pytest -m sglang_fast` runs in .ci/run): SGLang 0.5.12 and
0.5.23 build the main model and the MTP draft of every toy family and export kind with their own config parsing,
module construction and weight loaders (tests_engines/sglang_probe.py; what its shim replaces is at its top), and
the outcome must be what `quant verify-manifest --engine sglang==<release>` predicts:

- predicted to load: both models load, no parameter with a checkpoint source is left unwritten, every parameter
  equals the checkpoint's bytes (fused modules concatenated as SGLang fuses them), and every quantized weight
  (MXFP4, FP8 per channel, block FP8) decoded from what SGLang holds (MXFP4 by SGLang 0.5.23's own
  `_dequant_mxfp4_to_bf16`, by ml_dtypes in 0.5.12, which has no CPU decode; FP8 by ml_dtypes) equals
  quant.dequant's BF16 reading of the export; at least one weight of every quantized (format, MoE | linear) kind
  the export holds for that model was decoded and compared, and a weight that cannot be decoded is a failure;
- predicted to fail: SGLang raises or loads wrong values ("loads-wrong": silently wrong loads are failures too),
  and the module SGLang names is one the preflight names; a deliberately broken export (cases.SGLANG_BROKEN) must
  fail exactly as recorded per model: outcome, exception type and message, module;
- BF16 toys: predicted to load (the preflight checks quantized exports only), values compared as above;
- a checkpoint SGLang cannot build here (cases.SGLANG_CANNOT_BUILD, with the reason read from its error): the
  recorded outcome, asserted, so a release that starts building it fails the expectation instead of passing silently.

Runs with .venv-sglang's interpreter (`make .venv-sglang/.installed`). An engine that cannot be imported or set up
is an ERROR of the test, never a pass or a skip.
"""

from __future__ import annotations

import json

import pytest

from tests_engines.cases import (SGLANG_BROKEN, SGLANG_RELEASES, decoded_kinds, expectation_miss,
                                 materialize_sglang, quantized_kinds, run_sglang, sglang_cannot_build, sglang_cases,
                                 sglang_expectation_miss, sglang_named_modules, sglang_outcome, sglang_preflight_miss,
                                 sglang_prediction)

CASES = sglang_cases()


@pytest.fixture(scope="session")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("sglang")


def _params():
    out = []
    for case in CASES:
        for release in SGLANG_RELEASES:
            marks = [pytest.mark.sglang_fast] if case.fast else []
            out.append(pytest.param(case, release, id=f"{case.name}@{release}", marks=marks))
    return out


def _mtp_index(path) -> int:
    config = json.loads((path / "config.json").read_text())
    return config.get("text_config", config).get("num_hidden_layers", 0)


def _covers(predicted: str, named: str) -> bool:
    """The preflight's tensor or module `predicted` is the one SGLang names: equal, one inside the other, a name
    SGLang gives relative to the module it was loading (`experts.7.up_proj` from a FusedMoE weight loader's
    locals), or a finding on quantization_config itself (a scheme the release cannot build: every module it
    governs fails, so whichever SGLang names first is covered)."""
    if predicted.startswith("config.json:quantization_config"):
        return True
    if not named.startswith(("model.", "mtp.", "lm_head", "visual.", "language_model.")):
        return predicted.endswith("." + named) or ("." + named + ".") in predicted
    return predicted == named or predicted.startswith(named + ".") or named.startswith(predicted + ".")


def describe(result: dict) -> str:
    parts = []
    for which, m in result["models"].items():
        detail = m.get("error") or ""
        if m["outcome"] == "loads-wrong":
            detail = f"unwritten {m['unwritten'][:3]}, mismatched {[x['param'] for x in m['mismatched'][:3]]}"
        parts.append(f"{which}: {m['outcome']} {detail} {m.get('module') or m.get('tensor') or ''}".strip())
    return "; ".join(parts)


@pytest.mark.parametrize("case,release", _params())
def test_sglang_agrees_with_preflight(case, release, work, record_property):
    path, reference = materialize_sglang(case, work)
    expected = sglang_cannot_build(case, release)
    result = run_sglang(release, path, reference, setup_error_ok=bool(expected and "setup" in expected))
    if expected is not None:
        miss = sglang_expectation_miss(result, expected)
        assert miss is None, (f"SGLang {release}: {miss}; recorded because {expected['reason']}. If SGLang builds "
                              "it now, remove the SGLANG_CANNOT_BUILD entry and compare with the preflight")
        return
    errors = sglang_prediction(path, release) if case.scheme else []  # BF16 toys: nothing to predict, must load
    recorded = sglang_preflight_miss(case, release)
    if recorded is not None:  # a real failure the preflight does not model yet: asserted as recorded
        assert not errors, (f"the preflight now predicts {case.name} on {release} ({errors[0].message[:200]}): "
                            "remove its SGLANG_PREFLIGHT_MISSES entry")
        mtp_index = _mtp_index(path)
        for which, want in recorded.items():
            model = result["models"][which]
            miss = expectation_miss(model["outcome"], model.get("error", ""),
                                    sorted(sglang_named_modules(model, mtp_index)), want)
            assert miss is None, f"SGLang {release} {which}: {miss}"
        return
    predicted = "error" if errors else "pass"
    actual = sglang_outcome(result)
    assert actual == predicted, (f"SGLang {release}: {describe(result)}; preflight predicted {predicted}"
                                 + (f" ({errors[0].tensor}: {errors[0].message[:300]})" if errors else ""))
    if actual == "pass":
        for which, model in result["models"].items():
            if model["outcome"] == "absent":
                continue
            assert model["checked"] > 0, f"{which}: no parameter compared"
            if reference is None:  # a BF16 toy: nothing quantized to decode
                continue
            decoded = model.get("decoded", {})
            bad = {k: v for k, v in decoded.items() if "error" in v or v["diff"] != 0.0}
            assert not bad, f"{which}: SGLang's quantized weights decode differently from quant.dequant: {bad}"
            counts = decoded_kinds(model)
            missing = quantized_kinds(path, which) - set(counts)
            assert not missing, (f"{which}: no weight of kind {sorted(missing)} decoded and compared (decoded: "
                                 f"{counts})")
            record_property(f"decoded-{which}", {f"{f}/{k}": n for (f, k), n in sorted(counts.items())})
            if release != "0.5.12" and any(f == "mxfp4" for f, _ in counts):  # SGLang's own decode, not ours
                assert result["mxfp4_decoder"] == "sglang:_dequant_mxfp4_to_bf16", result["mxfp4_decoder"]
        return
    mtp_index = _mtp_index(path)
    broken = SGLANG_BROKEN.get((case.damage, release)) if case.damage else None
    if case.damage and not case.damage.startswith("spelling-"):
        assert broken is not None, f"no SGLANG_BROKEN entry for {case.damage} on {release}: record what SGLang raises"
    if broken is not None:  # a broken export: each model fails (or loads) exactly as recorded
        for which, want in broken.items():
            model = result["models"][which]
            named = sorted(sglang_named_modules(model, mtp_index)) if model["outcome"] != "loaded" else []
            miss = expectation_miss(model["outcome"], model.get("error", ""), named, want)
            assert miss is None, f"SGLang {release} {which}: {miss}"
        assert set(result["models"]) <= set(broken) | {m for m, v in result["models"].items()
                                                       if v["outcome"] == "absent"}, result["models"].keys()
    # Failures: the module SGLang names must be one the preflight names.
    named = set()
    for model in result["models"].values():
        if model["outcome"] not in ("loaded", "absent"):
            named |= sglang_named_modules(model, mtp_index)
    predicted_names = {f.tensor for f in errors if f.tensor}
    assert any(_covers(p, n) for p in predicted_names for n in named), (
        f"SGLang {release} names {sorted(named)}; the preflight names {sorted(predicted_names)[:8]}")


@pytest.mark.sglang_fast
def test_incident_mtp_aliases(work):
    """The incident: SGLang 0.5.12's NextN draft crashes on a GLM-5 export whose MTP layer is BF16 when
    quantization_config.exclude lacks the model.decoder.* aliases, and loads it with them; 0.5.23 loads both."""
    by_damage = {c.damage: c for c in CASES if c.toy == "glm5" and c.recipe == "experts-only-mtp-bf16"}
    without, _ = materialize_sglang(by_damage["decoder-aliases-dropped"], work)
    with_aliases, reference = materialize_sglang(by_damage[""], work)
    old = run_sglang("0.5.12", without)
    assert old["models"]["main"]["outcome"] == "loaded"
    assert old["models"]["draft"]["outcome"] == "load-error", describe(old)
    assert old["models"]["draft"]["class"] == "DeepseekV3ForCausalLMNextN"
    fixed = run_sglang("0.5.12", with_aliases, reference)
    assert sglang_outcome(fixed) == "pass", describe(fixed)
    assert sglang_outcome(run_sglang("0.5.23", without)) == "pass"
