"""The ownership property test at length: many more random worlds of user files, symlinks, forged owner records
and flag combinations than `make test` runs (tests/test_ownership_property.py, 24 worlds).

    python scripts/fuzz_ownership.py [--cases 500] [--seed 1000] [--workers 2]

Prints pytest's summary; exit 0 when every world kept every user file and every input.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=500)
    parser.add_argument("--seed", type=int, default=1000, help="first world's seed (make test uses 0..23)")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    env = {**os.environ, "QUANT_OWNERSHIP_CASES": str(args.cases), "QUANT_OWNERSHIP_SEED": str(args.seed)}
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-n", str(args.workers),
                            str(REPO / "tests" / "test_ownership_property.py")], cwd=REPO, env=env)


if __name__ == "__main__":
    sys.exit(main())
