"""`quant search` on the quantization-sensitive toy (tests/data/gptq_toy): the issue's done-when (#52)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quant.gptq.calibration import CalibrationSettings
from quant.search.solver import Option, best_within, pareto_front

REPO = Path(__file__).resolve().parent.parent
GPTQ_TOY = Path(__file__).parent / "data" / "gptq_toy"
CALIB = CalibrationSettings(str(GPTQ_TOY / "calib.jsonl"), samples=128, seq_len=128)
SMALL_CALIB = CalibrationSettings(str(GPTQ_TOY / "calib.jsonl"), samples=8, seq_len=32)


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
    assert nll["at-mixed"] <= nll["experts-mxfp4-rest-mxfp8"], nll  # no larger (above) and no worse
    lost = nll["all-linear"] - nll["bf16"]
    assert nll["all-linear"] - nll["halfway"] >= lost / 3, nll


@pytest.mark.slow
def test_search_for_sglang_0_5_12_picks_only_what_it_loads(tmp_path, one_torch_thread):
    from quant.search.run import measure
    from quant.search.searched import pick

    searched = measure(GPTQ_TOY / "model", ["sglang==0.5.12"], CALIB, log=lambda m: None)
    labels = {o.label for c in searched.choices for o in c.options}
    assert "mxfp8" not in labels  # SGLang 0.5.12 has no Quark MXFP8 scheme (engine rules `schemes`)
    chosen = pick(searched, max_size=10 ** 9)
    assert chosen is not None and all(c.options[i].label != "mxfp8" for c, i in zip(searched.choices, chosen))


def _search_cli(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "quant", "search", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=600)


def test_bad_budgets_and_sources_are_one_line_and_exit_2_before_any_work(tmp_path):
    from quant.toy.build import build_toy

    src = GPTQ_TOY / "model"
    taken = tmp_path / "taken.yaml"
    taken.write_text("mine\n")
    microscaled = build_toy("deepseek-v4", tmp_path / "v4")  # ships MXFP4 experts: nothing to search from BF16
    cases = {
        "give one budget": [src, "--out", tmp_path / "a.yaml", "--max-size", "900KB", "--bits", "6"],
        "give one budget: --max-size": [src, "--out", tmp_path / "b.yaml"],
        "--bits 20.0: must be between 1 and 16": [src, "--out", tmp_path / "c.yaml", "--bits", "20"],
        f"{taken} exists; pass --overwrite": [src, "--out", taken, "--bits", "6"],
        "--sensitivity hessian: one of kl, fisher": [src, "--out", tmp_path / "d.yaml", "--bits", "6",
                                                     "--sensitivity", "hessian"],
        "quant search reads a BF16 source (this one is microscaled)": [microscaled, "--out", tmp_path / "e.yaml",
                                                                       "--bits", "6"],
        # refused before --work is made: the state directory is the first thing the command writes
        "--sensitivity foo: one of kl, fisher": [src, "--out", tmp_path / "f.yaml", "--bits", "6", "--work",
                                                 tmp_path / "w1", "--sensitivity", "foo"],
        "missing.jsonl: calibration file not found": [src, "--out", tmp_path / "g.yaml", "--bits", "6", "--work",
                                                      tmp_path / "w2", "--calib-data", "missing.jsonl"],
        "--min-recovery 1.5: a fraction": [src, "--out", tmp_path / "h.yaml", "--min-recovery", "1.5", "--baseline",
                                           src, "--tasks", "toy_arith"],
        "its directory": [src, "--out", tmp_path / "nodir" / "i.yaml", "--bits", "6"],
    }
    for expected, args in cases.items():
        run = _search_cli(*args)
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and len(lines) == 1 and expected in lines[0], (args, run.stderr)
        assert "Traceback" not in run.stderr
    assert taken.read_text() == "mine\n"
    assert not any((tmp_path / f"{x}.yaml").exists() for x in "abcdefgh")
    assert not any((tmp_path / name).exists() for name in ("w1", "w2", "h.yaml.work", "nodir"))


@pytest.mark.slow
def test_search_writes_a_recipe_quantize_takes_and_the_front_as_json_and_png(tmp_path):
    """The command end to end on the sensitive toy (few calibration windows): the recipe, --json's fields, the
    PNG, and the export that recipe writes within the budget."""
    from quant.pipeline.run import quantize_checkpoint

    recipe, png = tmp_path / "mix.yaml", tmp_path / "front.png"
    run = _search_cli(GPTQ_TOY / "model", "--engine", "vllm", "--max-size", "900KB", "--calib-data",
                      GPTQ_TOY / "calib.jsonl", "--calib-samples", 8, "--calib-seq-len", 64, "--out", recipe,
                      "--plot", png, "--json")
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert {"recipe", "effective_bits", "size_bytes", "predicted_loss", "front", "sensitivity"} <= set(result)
    assert result["size_bytes"] <= 900_000 and result["sensitivity"] == "fisher"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    quantize_checkpoint(GPTQ_TOY / "model", tmp_path / "out", recipe=str(recipe), check_engines=None,
                        log=lambda m: None)
    assert sum(f.stat().st_size for f in (tmp_path / "out").glob("*.safetensors")) <= result["size_bytes"]
    again = _search_cli(GPTQ_TOY / "model", "--engine", "vllm", "--bits", "6", "--out", recipe)
    assert again.returncode == 2 and "exists" in again.stderr  # nothing it did not write is replaced


@pytest.mark.slow
def test_the_streamed_estimate_ranks_and_totals_as_the_exact_kl(one_torch_thread):
    """The Fisher estimate (one layer at a time) against the exact KL on the whole model, choice by choice."""
    import numpy as np
    from scipy.stats import spearmanr

    from quant.search.run import measure

    calib = CalibrationSettings(str(GPTQ_TOY / "calib.jsonl"), samples=64, seq_len=128)
    exact = measure(GPTQ_TOY / "model", ["vllm"], calib, log=lambda m: None, sensitivity="kl")
    estimate = measure(GPTQ_TOY / "model", ["vllm"], calib, log=lambda m: None, sensitivity="fisher")
    pairs = [(a.loss, b.loss) for ca, cb in zip(exact.choices, estimate.choices)
             for a, b in zip(ca.options, cb.options) if a.label != "bf16" and not ca.unit.mtp and a.loss > 0]
    assert len(pairs) >= 12
    kl, fisher = np.array(pairs).T
    assert spearmanr(kl, fisher).statistic >= 0.95
    assert 0.75 <= fisher.sum() / kl.sum() <= 1.33
    assert exact.pinned == estimate.pinned and [c.unit for c in exact.choices] == [c.unit for c in estimate.choices]


@pytest.mark.slow
@pytest.mark.parametrize("engines", [None, ["vllm"], ["sglang==0.5.12"]], ids=["serving", "vllm", "sglang-0.5.12"])
def test_every_toy_at_three_budgets_loads_in_the_releases_asked(tmp_path, one_torch_thread, engines):
    """Every assignment the search returns passes verify-manifest for the releases it searched for: each BF16 toy,
    at the smallest, a middle and the largest size of its Pareto front (the middle one asked as --bits). A toy the
    search refuses says why in one line: a microscaled release, a release that cannot parse the model, or an
    export no choice of the search's can make load (Qwen3.5's MTP experts, which every recipe keeps BF16, in
    vLLM 0.31)."""
    from quant.errors import QuantError
    from quant.pipeline.run import quantize_checkpoint
    from quant.checkpoint import open_checkpoint
    from quant.search.loadable import loadable_pick
    from quant.search.recipe_file import recipe_yaml
    from quant.search.run import measure
    from quant.search.solver import pareto_front
    from quant.toy.build import build_toy, toy_names
    from quant.verify import verify_checkpoint

    searched_toys, refused = 0, {}
    for name in toy_names():
        src = build_toy(name, tmp_path / name / "src")
        try:
            searched = measure(src, engines, SMALL_CALIB, log=lambda m: None)
            front = pareto_front([c.options for c in searched.choices])
            middle = front[len(front) // 2].choices
            budgets = {"smallest": {"max_size": searched.size(front[0].choices)},
                       "middle": {"bits": searched.effective_bits(middle)},
                       "largest": {"max_size": searched.size(front[-1].choices)}}
            opened = open_checkpoint(src)
            picks = {label: loadable_pick(opened, searched, engines, b.get("max_size"), b.get("bits"), "even",
                                          lambda m: None) for label, b in budgets.items()}
        except QuantError as e:
            refused[name] = str(e)
            continue
        searched_toys += 1
        for label, budget in budgets.items():
            chosen = picks[label]
            if chosen is None:  # the preflight took the smallest mixes off: nothing loadable fits this budget
                assert label == "smallest", (name, label)
                continue
            recipe = tmp_path / name / f"{label}.yaml"
            recipe.write_text(recipe_yaml(searched, chosen, label))
            out = tmp_path / name / label
            quantize_checkpoint(src, out, recipe=str(recipe), check_engines=None, log=lambda m: None)
            summary = json.loads((out / "quant_manifest.json").read_text())["summary"]
            if "bits" in budget:
                assert summary["effective_bits"] <= budget["bits"] + 1e-3, (name, summary)
            else:
                size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
                assert size <= budget["max_size"], (name, label, size)
            report = verify_checkpoint(out, engines=engines)
            assert not report.errors, (name, label, [f.message for f in report.errors])
    reasons = ("reads a BF16 source", "nothing it loads can be searched", "no choice the search makes changes this")
    assert all(any(r in why for r in reasons) for why in refused.values()), refused
    assert searched_toys >= 9, refused


@pytest.mark.slow
def test_the_export_preview_reads_as_the_export_itself(tmp_path):
    """quant.pipeline.preview (what the search verifies) against what quantize writes: the same tensors, dtypes,
    shapes and config.json, and verify-manifest's same findings, for every BF16 toy and three recipes."""
    from quant.checkpoint import open_checkpoint
    from quant.pipeline.preview import preview_checkpoint
    from quant.pipeline.run import quantize_checkpoint
    from quant.planning.plan import make_plan
    from quant.planning.recipes import family_for_config, load_recipe
    from quant.planning.schemes import DEFAULT_SCHEME, get_scheme
    from quant.sources.native import is_microscaled
    from quant.toy.build import build_toy, toy_names
    from quant.verify import verify_checkpoint

    def findings(ckpt):
        return sorted((f.severity, f.engine, f.versions, f.tensor, f.rule) for f in verify_checkpoint(ckpt).findings)

    compared = 0
    for name in toy_names():
        src = build_toy(name, tmp_path / name / "src")
        ckpt = open_checkpoint(src)
        if is_microscaled(ckpt):
            continue
        family = family_for_config(ckpt.config)
        for recipe in ("all-linear", "experts-mxfp4-rest-mxfp8", "experts-only"):
            plan = make_plan(ckpt, family, load_recipe(recipe, family), get_scheme(DEFAULT_SCHEME), "even")
            preview = preview_checkpoint(plan, ckpt)
            out = tmp_path / name / recipe
            quantize_checkpoint(src, out, recipe=recipe, check_engines=None, log=lambda m: None)
            real = open_checkpoint(out)
            assert {n: (t.dtype, t.shape) for n, t in preview.tensors.items()} == \
                {n: (t.dtype, tuple(t.shape)) for n, t in real.tensors.items()}, (name, recipe)
            assert preview.config == real.config, (name, recipe)
            assert findings(preview) == findings(real), (name, recipe)
            compared += 1
    assert compared >= 27


def test_an_interrupted_estimate_resumes_below_the_last_finished_layer(tmp_path, monkeypatch, one_torch_thread):
    """The streamed estimate with a state directory, cut off while scoring the second layer it reaches, then
    rerun: the finished layer is not scored again and every loss equals an uninterrupted run's; a changed
    calibration (another key) starts over."""
    import quant.search.fisher as fisher
    from quant.search.run import measure

    calib = CalibrationSettings(str(GPTQ_TOY / "calib.jsonl"), samples=8, seq_len=64)
    src, state = GPTQ_TOY / "model", tmp_path / "estimate"

    def losses(searched):
        return {c.unit.name: {o.label: o.loss for o in c.options} for c in searched.choices}

    whole = losses(measure(src, ["vllm"], calib, log=lambda m: None))
    scored: list[int] = []
    real = fisher._quantized

    def counting(stack, layer, index, linears, scale_mode):
        scored.append(index)
        if len(set(scored)) == 2 and os.environ.get("CUT") == "1":
            raise KeyboardInterrupt  # the second layer of the backward pass (layer 0 of gptq_toy's two)
        return real(stack, layer, index, linears, scale_mode)

    monkeypatch.setattr(fisher, "_quantized", counting)
    monkeypatch.setenv("CUT", "1")
    with pytest.raises(KeyboardInterrupt):
        measure(src, ["vllm"], calib, log=lambda m: None, state_dir=state)
    assert json.loads((state / "estimate.json").read_text())["next"] == 0
    monkeypatch.setenv("CUT", "0")
    scored.clear()
    lines: list[str] = []
    assert losses(measure(src, ["vllm"], calib, log=lines.append, state_dir=state)) == whole
    assert set(scored) == {0} and any("resuming the estimate below layer 1" in line for line in lines)
    scored.clear()
    other = CalibrationSettings(str(GPTQ_TOY / "calib.jsonl"), samples=8, seq_len=64, seed=1)
    measure(src, ["vllm"], other, log=lambda m: None, state_dir=state)
    assert set(scored) == {0, 1}  # another key: nothing reused


@pytest.mark.slow
def test_a_hub_source_is_downloaded_first_and_searched_as_the_local_copy(tmp_path):
    """`quant search ORG/NAME` against the project's Hub server (huggingface_hub's own client): the repository is
    downloaded into the HF cache within --max-disk, every file checked, and the recipe is the local copy's; a
    --max-disk below the repository's size is one line, exit 2, before anything is downloaded."""
    from hub_server import HubServer

    server = HubServer().start()
    try:
        server.add_repo("org/gptq-toy", GPTQ_TOY / "model", revisions=("main",), content_sha=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
        env.update({"HF_ENDPOINT": server.url, "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "home"),
                    "PYTHONPATH": str(REPO)})
        args = ["--engine", "vllm", "--max-size", "900KB", "--calib-data", GPTQ_TOY / "calib.jsonl",
                "--calib-samples", 8, "--calib-seq-len", 64]

        def run(src, out, *more, environ=None):
            return subprocess.run([sys.executable, "-m", "quant", "search", str(src), *map(str, args), "--out",
                                   str(out), *map(str, more)], capture_output=True, text=True, cwd=REPO,
                                  env=environ or env, timeout=600)

        small = run("org/gptq-toy", tmp_path / "none.yaml", "--max-disk", "100KB")
        assert small.returncode == 2 and len(small.stderr.strip().splitlines()) == 1, small.stderr
        assert "--max-disk" in small.stderr and not (tmp_path / "none.yaml").exists()
        hub = run("org/gptq-toy", tmp_path / "hub.yaml", "--max-disk", "10MB")
        assert hub.returncode == 0, hub.stderr
        local = run(GPTQ_TOY / "model", tmp_path / "local.yaml")
        assert local.returncode == 0, local.stderr
        assert (tmp_path / "hub.yaml").read_text() == (tmp_path / "local.yaml").read_text()
    finally:
        server.stop()
