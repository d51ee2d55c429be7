"""Which MTP treatment should the default recipe use? Measure it on the trained toy (evals/data/toy_arith/model,
GLM-5 layout, MTP layer trained): quantize it with `experts-only` (the MTP layer's experts MXFP4 like the main
layers') and `experts-only-mtp-bf16` (the MTP layer kept whole in BF16, AMD's GLM-5.2 choice), and compare the
two question by question with the eval stage (accuracy and MTP draft acceptance, in process), each also against
the block-FP8 baseline.

    python scripts/mtp_recipe.py [--limit 200] [--out /tmp/mtp-recipe] [--dtype float32]

Prints one line per comparison and the size of each export; BENCHMARKS.md ("MTP recipe") records the figures.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TOY = Path(__file__).resolve().parent.parent / "evals" / "data" / "toy_arith" / "model"


def compare_mtp(paths: dict, args, baseline: str, candidate: str, **kw) -> dict:
    """`quant eval`'s paired comparison of two checkpoints in `paths` on toy_arith, printed as one line (accuracy,
    depth-1 MTP acceptance with its interval); `args` carries out, limit, dtype and depth."""
    from evals.compare import EvalRequest, evaluate

    request = EvalRequest(candidate=str(paths[candidate]), baseline=str(paths[baseline]), tasks="toy_arith",
                          limit=args.limit, out=args.out / f"{candidate}-vs-{baseline}", dtype=args.dtype,
                          max_gen_toks=24, mtp_depth=args.depth, **kw)
    report = evaluate(request, log=lambda m: None).to_json()
    row = next(r for r in report["rows"] if r["primary"])
    c, a = row["comparison"], row["acceptance"]
    print(f"{candidate} vs {baseline} (n={c['n_questions']}): accuracy {100 * c['baseline_accuracy']:.1f} -> "
          f"{100 * c['candidate_accuracy']:.1f} ({c['verdict']}); depth-1 acceptance "
          f"{100 * a['baseline_rate']:.2f} -> {100 * a['candidate_rate']:.2f}, delta "
          f"{100 * a['rate_difference']:+.2f} [{100 * a['rate_ci_low']:+.2f}, {100 * a['rate_ci_high']:+.2f}] pt; "
          f"accepted length {a['baseline_length']:.3f} -> {a['candidate_length']:.3f} at depth {a['depth']} "
          f"({a['verdict']}); questions worse/better {a['questions_worse']}/{a['questions_better']}", flush=True)
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("/tmp/mtp-recipe"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--depth", type=int, default=3)
    args = parser.parse_args(argv)

    from quant.pipeline import quantize_checkpoint

    shutil.rmtree(args.out, ignore_errors=True)
    exports = {
        "fp8-block": dict(scheme="fp8-block", recipe="all-linear", check_engines=["transformers"]),
        "experts-only": dict(recipe="experts-only"),
        "experts-only-mtp-bf16": dict(recipe="experts-only-mtp-bf16"),
    }
    paths = {}
    for name, kw in exports.items():
        paths[name] = args.out / name
        quantize_checkpoint(TOY, paths[name], log=lambda m: None, **kw)
        size = sum(f.stat().st_size for f in paths[name].glob("*.safetensors"))
        print(f"{name}: {size / 1e6:.3f} MB of safetensors")


    compare_mtp(paths, args, "experts-only-mtp-bf16", "experts-only")
    compare_mtp(paths, args, "fp8-block", "experts-only-mtp-bf16")
    compare_mtp(paths, args, "fp8-block", "experts-only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
