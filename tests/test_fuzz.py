"""A bounded run of scripts/fuzz_preflight.py: mutated configs, Quark configs, indexes and shard headers of a
quantized export must give results or one-line QuantErrors from the preflight and quantize's planning, never
another exception or a hang (the script runs 10,000 cases; BENCHMARKS.md has the figures)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from fuzz_preflight import fuzz  # noqa: E402


def test_three_hundred_mutants_never_crash_or_hang():
    result = fuzz(cases=300, seed=1234, timeout=20.0)
    assert not result["crashes"], result["crashes"][:5]
