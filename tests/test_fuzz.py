"""A bounded run of scripts/fuzz_preflight.py: mutated configs, Quark configs, indexes and shard headers of a
quantized export must give results or one-line QuantErrors from the preflight and quantize's planning, never
another exception or a hang (the script runs 10,000 cases; BENCHMARKS.md has the figures)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from fuzz_preflight import fuzz  # noqa: E402


def test_three_hundred_mutants_never_crash_hang_or_grow():
    """300 mutants in-process under a 1 GB address-space cap, 6 of them also through `quant verify-manifest`
    with its exit code checked against the in-process outcome."""
    result = fuzz(cases=300, seed=1234, timeout=20.0, memory_mb=1024, cli_every=50)
    assert not result["crashes"], result["crashes"][:5]
    assert result["cli_runs"] == 6
