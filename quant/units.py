"""Sizes as people write them: `parse_size("80GB")` (the one size parser of every flag and config value that
takes bytes: --max-disk, --hessian-budget, --device-memory, a toy's shard size) and `human(n)`."""

from __future__ import annotations

import math

from quant.errors import QuantError

GIB = 1 << 30
UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10 ** 3, "kib": 1 << 10, "m": 1 << 20, "mb": 10 ** 6, "mib": 1 << 20,
         "g": GIB, "gb": 10 ** 9, "gib": GIB, "t": 1 << 40, "tb": 10 ** 12, "tib": 1 << 40}


def parse_size(text: object, flag: str) -> int:
    """'80GB', '80GiB', '4g', '512MiB', '0.5TB' or a number of bytes -> bytes (GB = 10^9, GiB = 2^30, a bare
    letter binary). A size that is not one, or not positive, is one line naming `flag` (exit 2)."""
    s = str(text).strip().lower().replace(" ", "")
    number = s.rstrip("kmgtib")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if unit not in UNITS or not math.isfinite(value) or value <= 0:
        raise QuantError(f"{flag} {text!r}: expected a size such as 80GB, 192GiB or 4GiB")
    return int(value * UNITS[unit])


def human(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / (1 << 20):.1f} MiB"


def decimal(n: float) -> str:
    """A byte count in the decimal units --max-disk takes (kB, MB, GB, TB), three significant digits: the same
    figure whether a progress bar or a summary line prints it."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} bytes"
