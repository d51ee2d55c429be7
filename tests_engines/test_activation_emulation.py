"""`quant eval --activations emulate` against amd-quark's own emulation (issue #33 item 5).

The eval's trained toy (evals/data/toy_arith/model) is exported W4A4 (w_mxfp4_a_mxfp4) and weight-only (w_mxfp4)
with every linear but the routed experts quantized (tests_engines/recipes/bf16-routed-experts.yaml: the Quark
export transformers can load). transformers 5.23 + amd-quark 0.13 load each through QuarkHfQuantizer in
.venv-quark (tests_engines/transformers_probe.py: Quark's QParamsLinear, its own MX emulation, nothing of ours);
the in-process backend loads the same export (evals.arms.backends.load_checkpoint_model: dequantized weights,
and with --activations emulate each quantized linear's input quantize-dequantized by quant.numerics). Their
per-token log-probabilities must agree within 1e-3 with emulate, and not with bf16 for W4A4; for the weight-only
export emulate changes nothing.

    QUARK_VENV=.venv-quark .venv/bin/python -m pytest -q tests_engines/test_activation_emulation.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from evals.arms.backends import load_checkpoint_model
from quant.pipeline import quantize_checkpoint
from tests_engines.cases import token_ids
from tests_engines.logprobs import teacher_forced
from tests_engines.transformers_cases import RECIPES, run

TOY = Path(__file__).resolve().parent.parent / "evals" / "data" / "toy_arith" / "model"
TOLERANCE = 1e-3  # largest |Δ log p| over every scored token (the done-when)


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(r) for r in a] == [len(r) for r in b]
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("activation-emulation")
    out = {}
    for scheme in ("w_mxfp4_a_mxfp4", "w_mxfp4"):
        out[scheme] = root / scheme
        quantize_checkpoint(TOY, out[scheme], scheme=scheme, recipe=str(RECIPES / "bf16-routed-experts.yaml"),
                            check_engines=None, log=lambda m: None)
    return out


def ours(export: Path, work: Path, activations: str, prompts) -> tuple[list[list[float]], str]:
    model, _, _, _ = load_checkpoint_model(export, work, activations=activations, device="cpu")
    return teacher_forced(model, prompts), model.quant_activations


def both_modes(export: Path, work: Path):
    """amd-quark's log-probabilities of `export` (it must load), ours with --activations emulate (and the mode that
    ran), ours with --activations bf16."""
    prompts = token_ids(TOY)
    quark = run(export, prompts)
    assert quark["outcome"] == "loaded", quark
    emulated, mode = ours(export, work / "emulate", "emulate", prompts)
    plain, _ = ours(export, work / "bf16", "bf16", prompts)
    return quark, emulated, mode, plain


def test_emulate_matches_amd_quark_for_w4a4(exports, tmp_path):
    quark, emulated, mode, plain = both_modes(exports["w_mxfp4_a_mxfp4"], tmp_path)
    assert mode == "emulate"
    delta = max_abs_diff(emulated, quark["logprobs"])
    without = max_abs_diff(plain, quark["logprobs"])
    print(f"W4A4: max |Δ log p| vs amd-quark: emulate {delta:.2e}, bf16 {without:.2e}")
    assert delta <= TOLERANCE, delta
    assert without > 20 * TOLERANCE, without  # the activations' effect is far beyond the tolerance


def test_emulate_leaves_a_weight_only_export_unchanged(exports, tmp_path):
    quark, emulated, mode, plain = both_modes(exports["w_mxfp4"], tmp_path)
    assert mode == "bf16" and emulated == plain
    delta = max_abs_diff(emulated, quark["logprobs"])
    print(f"w_mxfp4: max |Δ log p| vs amd-quark: {delta:.2e}")
    assert delta <= TOLERANCE, delta
