"""Golden eval report (issue #29): the report.json and report.md of a small deterministic in-process eval (the
demo's: the trained toy quantized to block FP8 as the baseline and to MXFP4 as the candidate, toy_arith, float32
on the CPU, with its MTP draft acceptance; 20 questions of at most 24 tokens to stay under a minute) are, after the volatile fields are normalised (the run's directory, lm-eval's version), what
tests/data/eval_report_golden.json recorded. A change of any key, order or value of the report fails here.

Record again after an intended change of the report: `python tests/test_eval_report_golden.py --record`."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parent / "data" / "eval_report_golden.json"
TRAINED_TOY = Path(__file__).resolve().parent.parent / "evals" / "data" / "toy_arith" / "model"
LIMIT = 20
MAX_GEN_TOKS = 24  # the longest toy answer fits (tests/test_eval_e2e.py)
ROOT = "<tmp>"  # the run's directory, in every path the report names

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(name="eval-e2e")]


def _normalise(text: str, root: Path) -> str:
    return text.replace(str(root), ROOT)


def eval_report(root: Path) -> dict:
    """Quantize the trained toy (block-FP8 baseline, MXFP4 candidate), evaluate both in process, and return the
    normalised report.json (parsed, key order kept) and report.md."""
    from evals.compare import EvalRequest, evaluate
    from quant.pipeline import quantize_checkpoint

    quantize_checkpoint(TRAINED_TOY, root / "arith-fp8", scheme="fp8-block", recipe="all-linear",
                        check_engines=None, log=lambda m: None)
    quantize_checkpoint(TRAINED_TOY, root / "arith-mxfp4", check_engines=None, log=lambda m: None)
    out = root / "report"
    evaluate(EvalRequest(candidate=str(root / "arith-mxfp4"), baseline=str(root / "arith-fp8"), tasks="toy_arith",
                         limit=LIMIT, max_gen_toks=MAX_GEN_TOKS, out=out, dtype="float32", device="cpu"),
             log=lambda m: None)
    report = json.loads(_normalise((out / "report.json").read_text(), root))
    report["settings"]["lm_eval_version"] = "<lm_eval version>"
    markdown = _normalise((out / "report.md").read_text(), root)
    markdown = markdown.replace(f"lm-eval {_lm_eval_version()}", "lm-eval <lm_eval version>")
    return {"report.json": report, "report.md": markdown.splitlines()}


def _lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def test_the_eval_report_is_the_golden_one(tmp_path, one_torch_thread):
    golden = json.loads(GOLDEN.read_text())
    computed = eval_report(tmp_path)
    assert computed["report.md"] == golden["report.md"]
    # json.dumps keeps the key order: the same keys, in the same order, with the same values
    assert json.dumps(computed["report.json"], indent=1) == json.dumps(golden["report.json"], indent=1)


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python tests/test_eval_report_golden.py --record")
    import torch

    torch.set_num_threads(1)  # as the test runs it (one_torch_thread)
    with tempfile.TemporaryDirectory() as tmp:
        GOLDEN.write_text(json.dumps(eval_report(Path(tmp).resolve()), indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {GOLDEN}")
