"""The transformers tier (`make test-engines`; a slice in CI): transformers 5.23 with amd-quark 0.13 loads every
export kind of every toy family through its own quantization integrations (tests_engines/transformers_probe.py,
in .venv-quark; nothing patched, nothing of this package on the engine's side), and the preflight's prediction
for `--engine transformers==5.23` must match what it does:
- an export it loads must give the log-probabilities of transformers on the dequantized export (with MXFP4
  activation QDQ on the W4A4 linears), while the quantization moves them well beyond that tolerance;
- an export it refuses or loads wrong must be predicted to fail, at the tensor transformers fails on.
"""

from __future__ import annotations

import re

import pytest

from tests_engines.cases import token_ids
from tests_engines.transformers_cases import (FAST, TOLERANCE, TRANSFORMERS_PREFLIGHT_MISSES, agrees, cases, judge,
                                             materialize, prediction, reference_qdq, run, tier_reference_logprobs)


@pytest.fixture(scope="session")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("transformers-tier")


def _params():
    return [pytest.param(c, id=c.name, marks=[pytest.mark.transformers_fast] if (c.toy, c.scheme, c.recipe) in FAST
                         else []) for c in cases()]


@pytest.mark.parametrize("case", _params())
def test_transformers_agrees(case, work):
    export, toy, reference = materialize(case, work)
    prompts = token_ids(toy)
    result = run(export, prompts)
    ref = tier_reference_logprobs(reference, prompts, reference_qdq(export)) if "logprobs" in result else None
    bf16 = tier_reference_logprobs(toy, prompts) if ref is not None else None
    verdict = judge(case, result, ref, bf16)
    if verdict["outcome"] == "loaded":
        # the quantization must be visible at this tolerance, or a misread weight could hide in it
        assert verdict["effect"] > 5 * TOLERANCE, verdict
    recorded = TRANSFORMERS_PREFLIGHT_MISSES.get(case.toy)
    if recorded is not None and case.scheme != "fp8-block":  # the outcome the preflight does not model, as recorded
        outcome, where, why = recorded
        assert verdict["outcome"] == outcome and re.search(where, verdict.get("where") or ""), (verdict, why)
        return
    miss = agrees(verdict, prediction(export))
    assert miss is None, miss
