"""The exact choice: a multiple-choice knapsack over units (pure functions, no torch).

Each unit takes exactly one of its options (bytes, predicted loss); the pick minimises the summed loss within a
byte budget. Exact by dynamic programming over the distinct reachable byte totals, with dominated states (more
bytes for no less loss) pruned: with a few formats per unit the frontier stays small, and no grid rounds a size.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    label: str  # the treatment, e.g. "scheme", "mxfp8", "fp8", "bf16"
    size_bytes: int
    loss: float


@dataclass(frozen=True)
class Pick:
    """One choice per unit (indices into each unit's options), with its totals."""

    choices: tuple[int, ...]
    size_bytes: int
    loss: float


def pareto_front(units: list[list[Option]]) -> list[Pick]:
    """Every non-dominated pick, smallest first: no other pick is as small and loses less."""
    front: list[Pick] = [Pick((), 0, 0.0)]
    for options in units:
        merged = [Pick(p.choices + (i,), p.size_bytes + o.size_bytes, p.loss + o.loss)
                  for p in front for i, o in enumerate(options)]
        front = _non_dominated(merged)
    return front


def _non_dominated(picks: list[Pick]) -> list[Pick]:
    # Sort by size then loss; keep a pick only if it loses strictly less than every smaller one kept. Ties in size
    # keep the lower loss, ties in both the first (the order of the menu: deterministic).
    out: list[Pick] = []
    for pick in sorted(picks, key=lambda p: (p.size_bytes, p.loss)):
        if not out or pick.loss < out[-1].loss:
            out.append(pick)
    return out


def best_within(units: list[list[Option]], max_bytes: int) -> Pick | None:
    """The least-loss pick whose bytes are at most `max_bytes` (None: even the smallest does not fit)."""
    fitting = [p for p in pareto_front(units) if p.size_bytes <= max_bytes]
    return fitting[-1] if fitting else None
