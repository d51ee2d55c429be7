"""Empirical coverage of the eval stage's paired interval (Tango's score interval) against the percentile
bootstrap it replaced, by simulation of paired binary outcomes.

    python scripts/coverage_paired.py [--sims 4000] [--seed 0]

For each n and discordance pattern it draws `sims` experiments (multinomial over candidate-only, baseline-only
and concordant questions), builds the nominal 95% interval and counts how often it contains the true
difference. The test suite runs a smaller version (tests/test_eval_stats.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evals.statistics.paired_interval import tango_interval  # noqa: E402


def bootstrap_interval(x: int, y: int, n: int, rng, iterations: int = 2000) -> tuple[float, float]:
    d = np.zeros(n)
    d[:x], d[x:x + y] = 1, -1
    means = d[rng.integers(0, n, size=(iterations, n))].mean(axis=1)
    return tuple(np.quantile(means, [0.025, 0.975]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sims", type=int, default=4000)
    parser.add_argument("--bootstrap-sims", type=int, default=300, help="the bootstrap is slow: fewer runs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    print("| n | discordance | favouring candidate | Tango coverage | bootstrap coverage |")
    print("|---|---|---|---|---|")
    worst = 1.0
    for n in (20, 50, 100, 200, 500):
        for rate in (0.0, 0.01, 0.02, 0.05, 0.1, 0.2):
            for share in (0.0, 0.2, 0.5, 0.8, 1.0):
                px, py = rate * share, rate * (1 - share)
                truth = px - py
                counts = rng.multinomial(n, [px, py, 1 - px - py], size=args.sims)
                tango = np.mean([lo <= truth <= hi for lo, hi in
                                 (tango_interval(float(x), float(y), float(n)) for x, y, _ in counts)])
                boot = np.mean([lo <= truth <= hi for lo, hi in
                                (bootstrap_interval(x, y, n, rng) for x, y, _ in counts[:args.bootstrap_sims])])
                worst = min(worst, tango)
                print(f"| {n} | {rate:.0%} | {share:.0%} | {tango:.3f} | {boot:.3f} |", flush=True)
    print(f"\nlowest Tango coverage: {worst:.3f} (nominal 0.95)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
