"""Where the package's run-time data lives.

Model families, recipes, engine profiles and toy configs ship inside the package (`quant/manifests/`, also
reachable as `manifests/` at the top of a checkout) and are found through `importlib.resources`, so an installed
`quant` works from any directory. `QUANT_MANIFESTS_DIR` points the tool at another copy (to try a changed
engine profile without reinstalling).
"""

import os
from importlib.resources import files
from pathlib import Path

MANIFESTS_DIR = Path(os.environ.get("QUANT_MANIFESTS_DIR") or str(files("quant").joinpath("manifests")))


def cache_root() -> Path:
    """The tool's cache (compiled kernels, built toys): $QUANT_CACHE_DIR, else $XDG_CACHE_HOME/moe-quant, else
    ~/.cache/moe-quant."""
    if os.environ.get("QUANT_CACHE_DIR"):
        return Path(os.environ["QUANT_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moe-quant"
