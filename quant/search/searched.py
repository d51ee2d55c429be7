"""What the search measured, as one record: each unit's priced and scored menu, the bytes outside the units, and
the budget's exact solve over it (the knapsack itself is solver.py's, pure)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from quant.search.solver import Option, pareto_front
from quant.search.units import Unit


@dataclass(frozen=True)
class Choice:
    unit: Unit
    options: list[Option]  # the menu, each with bytes (data + header) and measured KL (nats)
    data_bytes: dict[str, int]  # treatment -> stored bytes of values and scales (the effective bits' numerator)


@dataclass
class Searched:
    """Everything measured: the fixed bytes outside the units, each unit's priced menu, the linears' parameters."""

    fixed_bytes: int
    choices: list[Choice]
    params: int
    bf16_nll: float | None  # None where the estimate streamed (it never runs the whole model)
    pinned: dict[str, str] = field(default_factory=dict)  # MTP unit -> treatment (NLL never runs it)
    # MTP unit -> its whole loadable menu, smallest first (loss 0: unmeasured), for a caller that measures the draft
    mtp_menus: dict[str, Choice] = field(default_factory=dict)

    def effective_bits(self, picks: tuple[int, ...]) -> float:
        bits = sum(8 * c.data_bytes[c.options[i].label] for c, i in zip(self.choices, picks))
        return round(bits / self.params, 4)

    def size(self, picks: tuple[int, ...]) -> int:
        return self.fixed_bytes + sum(c.options[i].size_bytes for c, i in zip(self.choices, picks))

    def with_mtp(self, treatment: str) -> Searched:
        """The same search with every MTP unit pinned to `treatment` (on each one's menu) instead."""
        def pinned(c: Choice) -> Choice:
            full = self.mtp_menus[c.unit.name]
            option = next(o for o in full.options if o.label == treatment)
            return Choice(c.unit, [option], {treatment: full.data_bytes[treatment]})

        return replace(self, choices=[pinned(c) if c.unit.name in self.mtp_menus else c for c in self.choices],
                       pinned={u: treatment for u in self.pinned})


def pick(searched: Searched, max_size: int | None = None, bits: float | None = None,
         banned: frozenset[tuple[int, str]] = frozenset()) -> tuple[int, ...] | None:
    """The least predicted loss within `max_size` bytes of shards, or `bits` effective bits, never taking a
    (unit index, treatment) of `banned`."""
    allowed = [[i for i, o in enumerate(c.options) if (k, o.label) not in banned]
               for k, c in enumerate(searched.choices)]
    if not all(allowed):
        return None
    if bits is not None:
        units = [[Option(c.options[i].label, c.data_bytes[c.options[i].label], c.options[i].loss) for i in a]
                 for c, a in zip(searched.choices, allowed)]
        budget = int(bits * searched.params // 8)
    else:
        units = [[c.options[i] for i in a] for c, a in zip(searched.choices, allowed)]
        budget = int(max_size or 0) - searched.fixed_bytes
    fitting = [p for p in pareto_front(units) if p.size_bytes <= budget]
    return tuple(a[i] for a, i in zip(allowed, fitting[-1].choices)) if fitting else None
