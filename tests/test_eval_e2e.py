"""End to end on the trained toy (evals/data/toy_arith/model, GLM-5 layout with its MTP layer): quantize it to
block FP8 (baseline) and MXFP4 (candidate), score both in process through lm-eval's GSM8K pipeline, and check the
verdicts: the correct MXFP4 export passes, an export with swapped nibbles fails, and exports whose MTP layer alone
is damaged pass on accuracy and fail on draft acceptance. Also GPQA's seeded sampling path
on a synthetic CSV."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from evals.compare import EvalRequest, evaluate
from evals.report.render import REPORT_JSON, REPORT_MD, REPORT_PNG
from quant.checkpoint import open_checkpoint
from quant.errors import QuantError
from quant.pipeline import quantize_checkpoint
from test_eval_tasks import write_gpqa_csv

FIXTURE = Path(__file__).parent.parent / "evals" / "data" / "toy_arith" / "model"
LIMIT = 120
# Non-inferiority margin for the toy: on 120 questions one or two flipped answers already put a 95% interval's
# lower bound near -2 points; the broken export loses over 80 points. max_gen_toks 24 covers the longest answer.
MARGIN = 5.0

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(name="eval-e2e")]


def swap_nibbles(src: Path, out: Path) -> Path:
    """A broken copy of an MXFP4 export: the two 4-bit codes of every packed byte exchanged (element 2i read as
    2i+1), everything else, config included, unchanged, so it still loads and looks like a valid checkpoint."""
    shutil.copytree(src, out)
    ckpt = open_checkpoint(out)
    swapped = 0
    for file in ckpt.files:
        tensors = load_file(out / file)
        for name, t in tensors.items():
            if name.endswith(".weight") and t.dtype == torch.uint8 and name[:-7] + ".weight_scale" in ckpt.tensors:
                tensors[name] = ((t & 0x0F) << 4) | (t >> 4)
                swapped += 1
        save_file(tensors, out / file, metadata={"format": "pt"})
    assert swapped > 0
    return out


MTP_PREFIX = "model.layers.2."  # the trained toy's MTP layer (num_hidden_layers 2)


def damage_mtp(src: Path, out: Path, how: str) -> Path:
    """A copy of an MXFP4 export whose MTP layer alone is damaged, the main model byte-identical:
    "dropped": every MTP tensor re-drawn at random (an engine that never loads them runs its random init;
    vllm#37667), "zero-scales": every E8M0 scale of the MTP layer zeroed (its routed and shared experts),
    "swapped-nibbles": the packed codes of every MXFP4 weight of the MTP layer (its routed and shared experts)
    exchanged within each byte. (Damaging the routed experts alone costs this toy's draft about 5 points of
    depth-1 acceptance: its MTP layer leans on attention and the shared expert.)"""
    shutil.copytree(src, out)
    ckpt = open_checkpoint(out)
    generator = torch.Generator().manual_seed(0)
    changed = 0
    for file in ckpt.files:
        tensors = load_file(out / file)
        for name, t in tensors.items():
            if not name.startswith(MTP_PREFIX):
                continue
            if how == "dropped":
                if t.dtype == torch.uint8 and name.endswith(".weight"):
                    tensors[name] = torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=generator)
                elif t.dtype != torch.uint8:
                    norm = "norm" in name
                    fresh = torch.ones(t.shape) if norm else 0.02 * torch.randn(t.shape, generator=generator)
                    tensors[name] = fresh.to(t.dtype)
                else:
                    continue
            elif how == "zero-scales" and name.endswith(".weight_scale"):
                tensors[name] = torch.zeros_like(t)
            elif how == "swapped-nibbles" and t.dtype == torch.uint8 and name.endswith(".weight"):
                tensors[name] = ((t & 0x0F) << 4) | (t >> 4)
            else:
                continue
            changed += 1
        save_file(tensors, out / file, metadata={"format": "pt"})
    assert changed > 0, how
    return out


def quantize_exports(root: Path) -> dict[str, Path]:
    fp8 = root / "fp8-block"
    mxfp4 = root / "mxfp4"
    quantize_checkpoint(FIXTURE, fp8, scheme="fp8-block", check_engines=None, log=lambda m: None)
    quantize_checkpoint(FIXTURE, mxfp4, scheme="w_mxfp4_a_mxfp4", check_engines=None, log=lambda m: None)
    exports = {"fp8": fp8, "mxfp4": mxfp4, "broken": swap_nibbles(mxfp4, root / "mxfp4-swapped-nibbles")}
    for how in ("dropped", "zero-scales", "swapped-nibbles"):
        exports[f"mtp-{how}"] = damage_mtp(mxfp4, root / f"mxfp4-mtp-{how}", how)
    return exports


def run(baseline, candidate, out, **kw):
    settings = {"tasks": "toy_arith", "limit": LIMIT, "max_gen_toks": 24, "batch_size": 40, "margin": MARGIN, **kw}
    request = EvalRequest(candidate=str(candidate), baseline=baseline and str(baseline), out=out, **settings)
    return evaluate(request, log=lambda m: None).to_json()


def primary(report):
    return next(r for r in report["rows"] if r["primary"])


# One test on purpose: the exports and the FP8 baseline's answers are shared, and pytest-xdist may place
# separate tests on separate workers.
def test_correct_mxfp4_export_passes_and_swapped_nibbles_fail(tmp_path):
    exports = quantize_exports(tmp_path / "exports")
    first = tmp_path / "fp8-vs-mxfp4"
    report = run(exports["fp8"], exports["mxfp4"], first)
    row = primary(report)["comparison"]
    assert row["baseline_accuracy"] >= 0.85, "the trained toy must be accurate under block FP8"
    assert row["n_questions"] == LIMIT
    assert report["verdict"] == "pass" and report["exit_code"] == 0, row
    assert report["baseline"]["name"] == "FP8" and report["candidate"]["name"] == "MXFP4"
    # both schemes quantize activations: emulated by default (MXFP4 blocks; block FP8's per-token groups)
    assert report["candidate"]["activations"] == report["baseline"]["activations"] == "emulate"
    assert "activations emulated" in " ".join(report["candidate"]["notes"])
    for name in (REPORT_JSON, REPORT_MD, REPORT_PNG):
        assert (first / name).stat().st_size > 0
    md = (first / REPORT_MD).read_text()
    assert ("| Eval | n | FP8 baseline | MXFP4 | Δ (pt) | 95% CI (pt) | recovery [95% CI] | McNemar p | n to pass |"
            in md)
    assert "- candidate: emulated (--activations emulate): each quantized linear's input" in md
    assert json.loads((first / REPORT_JSON).read_text())["verdict"] == "pass"
    samples = (first / "runs" / "candidate" / "toy_arith" / "samples.jsonl").read_text().splitlines()
    assert len(samples) == 2 * LIMIT  # one record per question per filter
    # The trained MTP head drafts well in both arms, and quantizing its experts costs no acceptance.
    acceptance = primary(report)["acceptance"]
    assert acceptance["baseline_rate"] >= 0.9 and acceptance["candidate_rate"] >= 0.9, acceptance
    assert acceptance["candidate_length"] > 3.0 and acceptance["verdict"] == "pass", acceptance
    assert "## MTP draft acceptance" in md and "mean accepted length at depth 3" in md

    # Exports whose MTP layer alone is damaged: every answer is the correct export's, the accuracy verdict still
    # passes, and only the acceptance check fails.
    for how in ("dropped", "zero-scales", "swapped-nibbles"):
        report = run(None, exports[f"mtp-{how}"], tmp_path / f"fp8-vs-mtp-{how}", baseline_run=first)
        row, acceptance = primary(report)["comparison"], primary(report)["acceptance"]
        assert row["verdict"] == "pass", (how, row)
        assert acceptance["verdict"] == "fail" and report["verdict"] == "fail", (how, json.dumps(acceptance))
        assert acceptance["rate_ci_high"] < -0.1 and acceptance["candidate_length"] < 3.0, (how, json.dumps(acceptance))

    # The broken export against the same FP8 answers, reused from the first run (--baseline-run).
    report = run(None, exports["broken"], tmp_path / "fp8-vs-broken", baseline_run=first)
    assert report["baseline"]["reused_from"] == str(first)
    row = primary(report)["comparison"]
    assert report["verdict"] == "fail" and report["exit_code"] == 1, row
    assert row["ci_high"] < -MARGIN / 100
    assert row["baseline_only_correct"] > 10 * max(1, row["candidate_only_correct"])
    assert row["mcnemar_p"] < 1e-6
    with pytest.raises(QuantError, match=rf"ran with limit={LIMIT}, this run uses {LIMIT - 1}"):
        run(None, exports["broken"], tmp_path / "other", baseline_run=first, limit=LIMIT - 1)


def read_samples(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_gpqa_seeds_sample_differently_and_pair_per_question(tmp_path):
    csv_path = write_gpqa_csv(tmp_path / "gpqa.csv", n=6)
    twin = tmp_path / "twin"  # the same weights under another checkpoint (a model compared with itself, even a
    shutil.copytree(FIXTURE, twin)  # byte-identical copy of it, is refused): one more file, which no loader reads
    (twin / "README.md").write_text("the toy's weights, another checkpoint\n")
    with pytest.raises(QuantError, match="max_gen_toks 32768 leaves no room for the prompt"):
        run(FIXTURE, twin, tmp_path / "default-length", tasks="gpqa_diamond", limit=None, gpqa_csv=csv_path,
            max_gen_toks=None)
    out = tmp_path / "out"
    report = run(FIXTURE, twin, out, tasks="gpqa_diamond", limit=None, seeds=2, gpqa_csv=csv_path,
                 max_gen_toks=12)
    row = primary(report)
    assert row["seeds"] == [0, 1]
    assert row["comparison"]["samples_per_question"] == 2 and row["comparison"]["n_questions"] == 6
    runs = out / "runs"
    seed0 = read_samples(runs / "baseline" / "gpqa_diamond-seed0" / "samples.jsonl")
    seed1 = read_samples(runs / "baseline" / "gpqa_diamond-seed1" / "samples.jsonl")
    again = read_samples(runs / "candidate" / "gpqa_diamond-seed1" / "samples.jsonl")
    assert [r["prompt_hash"] for r in seed0] == [r["prompt_hash"] for r in seed1], "same prompt for every seed"
    assert [r["response"] for r in seed0] != [r["response"] for r in seed1], "seeds must change the samples"
    assert [r["response"] for r in seed1] == [r["response"] for r in again], "a seed must reproduce its samples"
    # Same model, same seeds: identical answers, so the paired difference is exactly zero; 6 questions are far
    # too few to show non-inferiority, and the interval says so instead of collapsing to [0, 0].
    comparison = row["comparison"]
    assert comparison["difference"] == 0.0 and comparison["ci_low"] < -0.3 < 0.3 < comparison["ci_high"]
    assert comparison["n_to_pass"] > 6
    # The arithmetic toy cannot answer GPQA: an arm at or below chance (25%) gets no verdict (invalid), and the row
    # itself says so (one record behind every surface), else the interval leaves it inconclusive.
    at_floor = min(comparison["baseline_accuracy"], comparison["candidate_accuracy"]) <= 0.25
    assert report["verdict"] == comparison["verdict"] == ("invalid" if at_floor else "inconclusive"), comparison
    assert ("validity" in row) == at_floor
