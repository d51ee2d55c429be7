"""`quant search` on the quantization-sensitive toy (tests/data/gptq_toy): the issue's done-when (#52)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quant.gptq.calibration import CalibrationSettings
from quant.search.solver import Option, best_within, pareto_front

GPTQ_TOY = Path(__file__).parent / "data" / "gptq_toy"
CALIB = CalibrationSettings(str(GPTQ_TOY / "calib.jsonl"), samples=128, seq_len=128)


def test_the_solver_is_exact_against_every_combination():
    import itertools
    import random

    rng = random.Random(0)
    units = [[Option(str(i), rng.randint(1, 50), rng.random()) for i in range(rng.randint(1, 4))] for _ in range(6)]
    for budget in range(0, 320, 7):
        combos = [c for c in itertools.product(*[range(len(u)) for u in units])
                  if sum(units[k][i].size_bytes for k, i in enumerate(c)) <= budget]
        best = best_within(units, budget)
        if not combos:
            assert best is None
            continue
        want = min(sum(units[k][i].loss for k, i in enumerate(c)) for c in combos)
        assert best is not None and best.size_bytes <= budget and best.loss == pytest.approx(want)
    front = pareto_front(units)
    assert all(a.size_bytes < b.size_bytes and a.loss > b.loss for a, b in zip(front, front[1:]))


def _export(src: Path, out: Path, recipe: str) -> int:
    from quant.pipeline.run import quantize_checkpoint

    quantize_checkpoint(src, out, recipe=recipe, check_engines=None, log=lambda m: None)
    return sum(f.stat().st_size for f in out.glob("*.safetensors"))


@pytest.mark.slow
def test_search_beats_the_uniform_recipes_and_loads_in_vllm(tmp_path, one_torch_thread):
    from evals.arms.nll import mean_nll  # the held-out measure lives in the eval stage; the search never imports it
    from quant.search.run import search
    from quant.verify import verify_checkpoint
    from tests.test_gptq import gptq_toy_heldout

    src = GPTQ_TOY / "model"
    texts = gptq_toy_heldout(windows=10 ** 6)  # all 100 held-out problems (402 windows), not the first 30
    sizes = {r: _export(src, tmp_path / r, r) for r in ("all-linear", "experts-mxfp4-rest-mxfp8")}
    nll = {r: mean_nll(tmp_path / r, texts) for r in sizes}
    nll["bf16"] = mean_nll(src, texts)
    budgets = {"at-mixed": sizes["experts-mxfp4-rest-mxfp8"],
               "halfway": (sizes["experts-mxfp4-rest-mxfp8"] + sizes["all-linear"]) // 2}
    for label, budget in budgets.items():
        result = search(src, ["vllm"], CALIB, max_size=budget, log=lambda m: None)
        recipe = tmp_path / f"{label}.yaml"
        recipe.write_text(result["recipe_yaml"])
        size = _export(src, tmp_path / label, str(recipe))
        assert size <= budget and result["size_bytes"] >= size  # the predicted size bounds the real one
        manifest = json.loads((tmp_path / label / "quant_manifest.json").read_text())
        assert manifest["summary"]["effective_bits"] == pytest.approx(result["effective_bits"], abs=1e-3)
        nll[label] = mean_nll(tmp_path / label, texts)
        report = verify_checkpoint(tmp_path / label, engines=["vllm"])
        assert not report.errors, [f.message for f in report.errors]
    lost = nll["all-linear"] - nll["bf16"]
    assert nll["all-linear"] - nll["halfway"] >= lost / 3, nll


@pytest.mark.slow
def test_search_for_sglang_0_5_12_picks_only_what_it_loads(tmp_path, one_torch_thread):
    from quant.search.run import measure, pick

    searched = measure(GPTQ_TOY / "model", ["sglang==0.5.12"], CALIB, log=lambda m: None)
    labels = {o.label for c in searched.choices for o in c.options}
    assert "mxfp8" not in labels  # SGLang 0.5.12 has no Quark MXFP8 scheme (engine rules `schemes`)
    chosen = pick(searched, max_size=10 ** 9)
    assert chosen is not None and all(c.options[i].label != "mxfp8" for c, i in zip(searched.choices, chosen))
