"""Family adapters: the few things a family file cannot say as data, as small named functions.

A family file opts in with `adapter: NAME`. An adapter gets the config.json dict and returns the config the
family's data is evaluated against (shape formulas, MTP counts), e.g. a release that spells a key its own way.
None of the families shipped needs one today: wrappers, prefixes, MTP placement, runtime names and release
recipes are all data. The registry is where one goes when a family needs it.
"""

from __future__ import annotations

from typing import Callable

ADAPTERS: dict[str, Callable[[dict], dict]] = {}
