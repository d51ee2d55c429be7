"""Which engine releases load a scheme comes from the engine rules, not from a table of the planner's: each scheme
names its kind in the rules' `schemes` tables, that kind is what the preflight classifies the layer config the
writer writes as, and the releases are those whose Linear and FusedMoE both build it."""

from __future__ import annotations

import pytest

from quant.engines import select_profiles
from quant.pipeline.quark_config import layer_config
from quant.planning.schemes import SCHEMES
from quant.verify.schema import classify

QUARK = [name for name, s in SCHEMES.items() if s.output_format == "quark"]


@pytest.mark.parametrize("name", QUARK)
def test_a_schemes_kind_is_what_the_preflight_reads_in_its_written_config(name):
    assert classify(layer_config(name, "even")) == SCHEMES[name].engine_kind


@pytest.mark.parametrize("name", QUARK)
def test_a_scheme_loads_in_the_releases_whose_rules_build_it(name):
    kind = SCHEMES[name].engine_kind
    loading = [p.label for p in select_profiles(["sglang", "vllm"])
               if p.rules.schemes.linear.get(kind) == "ok" and p.rules.schemes.moe.get(kind) == "ok"]
    assert [p.label for p in select_profiles(list(SCHEMES[name].engines))] == loading


def test_the_releases_as_the_engine_rules_say_today():
    assert SCHEMES["w_mxfp4_a_mxfp4"].engines == ("sglang", "vllm")
    assert SCHEMES["w_mxfp4"].engines == ("vllm==0.32", "vllm==0.33")  # vLLM 0.31 cannot build W4A16 MXFP4
    assert SCHEMES["w_mxfp8_a_mxfp8"].engines == ("vllm==0.33",)  # MXFP8 experts from vLLM 0.33
    assert SCHEMES["fp8-block"].engines == ("sglang", "vllm")  # not a Quark scheme: every serving engine
