"""The verdict of a comparison, of the MTP acceptance and of the whole eval (pure: no I/O)."""

from __future__ import annotations

from enum import Enum


class Verdict(str, Enum):
    """pass / fail / inconclusive (non-inferiority against a margin), invalid (an arm at or below its floor: no
    evidence either way, evals/statistics/evidence.py). A str, so it compares equal to, and is written to JSON as,
    its value."""

    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"
    INVALID = "invalid"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)
