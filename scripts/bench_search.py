"""Benchmark: `quant search`'s pick against the uniform built-in recipes and random mixes of the same size.

For each trained toy (GLM-5 layout):
  - gptq_toy: tests/data/gptq_toy/model (the suite's quantization-sensitive toy), calibrated on its calib.jsonl
    (128 windows of 128 tokens), scored on all 402 windows of `tests.test_gptq.gptq_toy_heldout` (its
    heldout.jsonl);
  - toy_arith: evals/data/toy_arith/model (the QAT-trained arithmetic toy), calibrated on its train.jsonl and scored
    on its test.jsonl, both as gptq_toy_heldout builds its windows (each record's text, records joined by "\\n\\n";
    held-out cut into 128-char windows: `arith_heldout`; calibration 128 windows of 128 tokens). A record's text is
    the layout the toy was trained on, "Question: q\\nAnswer: a" (scripts/train_toy_arith.py); `--arith-layout
    bare` uses gptq_toy's "q\\na" instead, text the toy never saw (its BF16 NLL is then about 8.6 nats/token,
    above a uniform guess over its 258 tokens, and the quantized exports' NLLs move at random around it);
this script
  1. runs `quant.search.run.measure` with engines ["vllm"] once per sensitivity, the streamed Fisher estimate
     (the default) and the exact KL (its wall time is the search's own cost);
  2. exports every uniform built-in recipe (`quant.planning.recipes.recipe_names()`; one that fails to plan or
     export prints one line and is left out) with `quantize_checkpoint`, and the BF16 source is scored too;
  3. takes three budgets of shard bytes: (a) the experts-mxfp4-rest-mxfp8 export's, (b) halfway between that and
     all-linear's, (c) all-linear's × 1.05; for each: the search's pick under each sensitivity
     (`loadable_pick`, as `quant search` picks, written by `recipe_yaml` and exported with it), every uniform
     recipe whose export fits, and `--random` random
     assignments (one option per unit drawn uniformly, seeded; rejection-sampled until the predicted size
     `searched.size` lies in [0.95 × budget, budget], at most MAX_ATTEMPTS draws) exported and scored: min /
     median / max and the pick's rank among them.
Every checkpoint is scored by the same code (`evals.arms.nll.mean_nll`, fp32 on CPU). Reported per row: shard
bytes (sum of *.safetensors), effective bits (the export's quant_manifest.json summary), held-out NLL, its rise over
BF16, and the share of all-linear's rise recovered, (NLL_all_linear - NLL) / (NLL_all_linear - NLL_bf16). One
markdown table per toy is printed and every row is written to WORK/bench_search.json.

    .venv/bin/python scripts/bench_search.py [--toys gptq_toy,toy_arith] [--random 20] [--seed 0]
        [--work /tmp/bench-search] [--arith-layout trained|bare]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

ENGINES = ["vllm"]
MAX_ATTEMPTS = 200_000  # random draws per budget before giving up on filling --random
ARITH = REPO / "evals" / "data" / "toy_arith"
GPTQ_TOY = REPO / "tests" / "data" / "gptq_toy"


def arith_text(row: dict, layout: str) -> str:
    """One toy_arith record as text: the layout it was trained on (scripts/train_toy_arith.py's training_row, lm-eval's
    GSM8K few-shot layout) or gptq_toy_heldout's bare question + "\\n" + answer."""
    if layout == "trained":
        return f"Question: {row['question']}\nAnswer: {row['answer']}"
    return f"{row['question']}\n{row['answer']}"


def arith_heldout(layout: str = "trained", length: int = 128) -> list[str]:
    """toy_arith's test.jsonl as gptq_toy_heldout builds its windows: each record's text (`arith_text`), records
    joined by "\\n\\n", cut into `length`-char windows (the last partial one dropped)."""
    rows = [json.loads(line) for line in (ARITH / "test.jsonl").read_text().splitlines() if line.strip()]
    joined = "\n\n".join(arith_text(r, layout) for r in rows)
    return [joined[i:i + length] for i in range(0, len(joined) - length + 1, length)]


def arith_calibration(work: Path, layout: str) -> Path:
    """train.jsonl as a calibration file: one {"text": ...} record per row in `layout` (the calibration code joins
    records by a blank line, as the model was trained). "bare" is train.jsonl itself (its string fields joined by
    a newline: the same text)."""
    if layout == "bare":
        return ARITH / "train.jsonl"
    rows = [json.loads(line) for line in (ARITH / "train.jsonl").read_text().splitlines() if line.strip()]
    path = work / "toy_arith-calib.jsonl"
    path.write_text("".join(json.dumps({"text": arith_text(r, layout)}) + "\n" for r in rows))
    return path


def toys(work: Path, arith_layout: str) -> dict:
    from quant.gptq.calibration import CalibrationSettings
    from tests.test_gptq import gptq_toy_heldout

    return {
        "gptq_toy": (GPTQ_TOY / "model", CalibrationSettings(str(GPTQ_TOY / "calib.jsonl"), samples=128, seq_len=128),
                     lambda: gptq_toy_heldout(windows=10 ** 6)),
        # train.jsonl: about 21k characters (byte-level tokens): 128 windows of 128 tokens at seeded offsets fit.
        "toy_arith": (ARITH / "model", CalibrationSettings(str(arith_calibration(work, arith_layout)), samples=128,
                                                           seq_len=128),
                      lambda: arith_heldout(arith_layout)),
    }


def export(src: Path, out: Path, recipe: str) -> tuple[int, float]:
    """Shard bytes and the manifest's effective bits of `src` quantized with `recipe` into `out`."""
    from quant.pipeline.run import quantize_checkpoint

    if out.exists():
        shutil.rmtree(out)
    quantize_checkpoint(src, out, recipe=recipe, check_engines=None, log=lambda m: None)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    manifest = json.loads((out / "quant_manifest.json").read_text())
    return size, manifest["summary"]["effective_bits"]


def random_draws(searched, budget: int, n: int, seed: int) -> tuple[list[tuple[int, ...]], int]:
    """Up to `n` assignments (one option per unit, uniform) whose predicted size is in [0.95 budget, budget]."""
    rng = random.Random(seed)
    lo, out, attempts = 0.95 * budget, [], 0
    while len(out) < n and attempts < MAX_ATTEMPTS:
        attempts += 1
        picks = tuple(rng.randrange(len(c.options)) for c in searched.choices)
        if lo <= searched.size(picks) <= budget:
            out.append(picks)
    return out, attempts


SENSITIVITIES = ("fisher", "kl")


def measure_each(src: Path, calib) -> dict[str, tuple]:
    """`measure` once per sensitivity: the Searched and its wall seconds (the search's own cost)."""
    import quant.search.run as run

    out = {}
    for sensitivity in SENSITIVITIES:
        t0 = time.perf_counter()
        searched = run.measure(src, ENGINES, calib, log=lambda m: None, sensitivity=sensitivity)
        out[sensitivity] = (searched, time.perf_counter() - t0)
    return out


def uniform_exports(name: str, src: Path, work: Path, texts: list[str]) -> dict[str, dict]:
    """Every built-in recipe exported and scored; one that fails prints one line and is left out."""
    from evals.arms.nll import mean_nll
    from quant.planning.recipes import recipe_names

    uniform: dict[str, dict] = {}
    for recipe in recipe_names():
        try:
            t0 = time.perf_counter()
            size, bits = export(src, work / f"recipe-{recipe}", recipe)
        except Exception as e:  # a recipe this toy or layout cannot take: one line, no row
            print(f"[{name}] recipe {recipe}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
            continue
        value = mean_nll(work / f"recipe-{recipe}", texts)
        uniform[recipe] = {"bytes": size, "effective_bits": bits, "nll": value}
        print(f"[{name}] recipe {recipe}: {size} bytes, {bits} bits, NLL {value:.5f} "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
    return uniform


def random_mixes(name: str, src: Path, work: Path, texts: list[str], searched, label: str, budget: int,
                 n_random: int, seed: int) -> tuple[list[tuple], int]:
    """The random assignments near `budget`, exported and scored: (NLL, bytes, bits, predicted bytes) each."""
    from quant.search import recipe_file
    from evals.arms.nll import mean_nll

    tag = label.split(":")[0]
    draws, attempts = random_draws(searched, budget, n_random, seed)
    if len(draws) < n_random:
        print(f"[{name}] budget {label}: only {len(draws)} of {n_random} random draws landed in "
              f"[0.95, 1] × budget after {attempts} attempts")
    scored = []
    t0 = time.perf_counter()
    for k, picks in enumerate(draws):
        path = work / f"random-{tag}.yaml"
        path.write_text(recipe_file.recipe_yaml(searched, picks, f"bench_search random {k}"))
        out = work / f"random-{tag}-{k}"
        size, bits = export(src, out, str(path))
        scored.append((mean_nll(out, texts), size, bits, searched.size(picks)))
        shutil.rmtree(out)
    print(f"[{name}] budget {label}: {len(scored)} random mixes scored ({time.perf_counter() - t0:.1f} s)",
          flush=True)
    return scored, attempts


def score_picks(name: str, src: Path, work: Path, texts: list[str], measured: dict, label: str, budget: int,
                row) -> list[dict]:
    """The search's pick at `budget` under each sensitivity, exported and scored: one row each."""
    from quant.checkpoint import open_checkpoint
    from quant.search import loadable, recipe_file
    from evals.arms.nll import mean_nll

    rows = []
    for sensitivity, (by, _) in measured.items():
        chosen = loadable.loadable_pick(open_checkpoint(src), by, ENGINES, budget, None, "even", lambda m: None)
        if chosen is None:
            print(f"[{name}] budget {label} ({budget}): the search finds no mix that fits")
            continue
        recipe = work / f"pick-{sensitivity}-{label.split(':')[0]}.yaml"
        recipe.write_text(recipe_file.recipe_yaml(by, chosen, f"bench_search {name} budget {label} {budget} bytes"))
        size, bits = export(src, recipe.with_suffix(""), str(recipe))
        value = mean_nll(recipe.with_suffix(""), texts)
        labels = [c.options[i].label for c, i in zip(by.choices, chosen)]
        mix = {t: labels.count(t) for t in dict.fromkeys(labels)}
        rows.append(row(label, f"search pick ({sensitivity})", size, bits, value, budget_bytes=budget,
                        predicted_bytes=by.size(chosen), predicted_bits=by.effective_bits(chosen),
                        predicted_loss=sum(c.options[i].loss for c, i in zip(by.choices, chosen)),
                        mix=mix, recipe={c.unit.name: t for c, t in zip(by.choices, labels)}))
        print(f"[{name}] budget {label} ({budget}): {sensitivity} pick {size} bytes (predicted {by.size(chosen)}), "
              f"{bits} bits, NLL {value:.5f}, units per format {mix}", flush=True)
    return rows


def bench_toy(name: str, src: Path, calib, heldout, work: Path, n_random: int, seed: int) -> dict:
    from evals.arms.nll import mean_nll

    work = work / name
    work.mkdir(parents=True, exist_ok=True)
    texts = heldout()
    t0 = time.perf_counter()
    bf16_nll = mean_nll(src, texts)
    bf16_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    print(f"[{name}] {len(texts)} held-out windows, BF16 NLL {bf16_nll:.5f} ({time.perf_counter() - t0:.1f} s)",
          flush=True)
    measured = measure_each(src, calib)
    searched = measured["fisher"][0]  # the units and options are the same whatever the sensitivity
    measure_s = {k: round(v[1], 1) for k, v in measured.items()}
    n_options = sum(len(c.options) for c in searched.choices)
    evals = sum(len(c.options) for c in searched.choices if not c.unit.mtp)
    print(f"[{name}] measure: {measure_s} s, {len(searched.choices)} units, {n_options} options", flush=True)
    uniform = uniform_exports(name, src, work, texts)
    for need in ("all-linear", "experts-mxfp4-rest-mxfp8"):
        if need not in uniform:
            raise SystemExit(f"[{name}] recipe {need} failed: the budgets need it")
    lin = uniform["all-linear"]["nll"]
    mixed_b, lin_b = uniform["experts-mxfp4-rest-mxfp8"]["bytes"], uniform["all-linear"]["bytes"]
    budgets = {"a: experts-mxfp4-rest-mxfp8": mixed_b, "b: halfway": (mixed_b + lin_b) // 2,
               "c: all-linear × 1.05": int(lin_b * 1.05)}

    def row(budget: str, what: str, size: int, bits: float, value: float, **extra) -> dict:
        rec = (lin - value) / (lin - bf16_nll) if lin != bf16_nll else None
        return {"toy": name, "budget": budget, "what": what, "bytes": size, "effective_bits": bits, "nll": value,
                "rise": value - bf16_nll, "recovered": rec, **extra}

    rows = [row("", "BF16 source", bf16_bytes, 16.0, bf16_nll)]
    rows += [row("", f"recipe {r}", u["bytes"], u["effective_bits"], u["nll"]) for r, u in uniform.items()]
    summary = {}
    for label, budget in budgets.items():
        picks_rows = score_picks(name, src, work, texts, measured, label, budget, row)
        rows += picks_rows
        rows += [row(label, f"recipe {r}", u["bytes"], u["effective_bits"], u["nll"], budget_bytes=budget)
                 for r, u in uniform.items() if u["bytes"] <= budget]
        scored, attempts = random_mixes(name, src, work, texts, searched, label, budget, n_random, seed)
        if not scored:
            continue
        values = sorted(s[0] for s in scored)
        by = sorted(scored)
        med = by[(len(by) - 1) // 2]  # the lower median as a real draw (its bytes and bits shown)
        for what, s in (("random min", by[0]), ("random median", med), ("random max", by[-1])):
            rows.append(row(label, f"{what} (n={len(scored)})", s[1], s[2], s[0], budget_bytes=budget))
        summary[label] = {"budget": budget, "random_n": len(scored), "random_attempts": attempts,
                          "random_nll": [s[0] for s in scored], "random_bytes": [s[1] for s in scored],
                          "random_median_nll": statistics.median(values)}
        for pick_row in picks_rows:
            rank = 1 + sum(v < pick_row["nll"] for v in values)
            pick_row["rank_among_random"] = f"{rank} of {len(scored) + 1}"
            summary[label][pick_row["what"]] = {"rank": rank, "nll": pick_row["nll"]}
    return {"toy": name, "measure_s": measure_s, "units": len(searched.choices), "options": n_options,
            "measured_options": evals, "heldout_windows": len(texts), "bf16_nll": bf16_nll, "rows": rows,
            "budgets": summary}


def table(result: dict) -> str:
    lines = [f"**{result['toy']}** (BF16 held-out NLL {result['bf16_nll']:.5f} over {result['heldout_windows']} "
             f"windows; measure {result['measure_s']} s, {result['units']} units, {result['measured_options']} "
             f"options measured)", "",
             "| budget | what | bytes | effective bits | held-out NLL | rise over BF16 | all-linear's rise recovered |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        budget = f"{r['budget']} ({r['budget_bytes']})" if r["budget"] else "—"
        what = r["what"] + (f", rank {r['rank_among_random']} with the random" if "rank_among_random" in r else "")
        rec = "—" if r["recovered"] is None else f"{round(100 * r['recovered']) + 0}%"
        lines.append(f"| {budget} | {what} | {r['bytes']} | {r['effective_bits']:.4f} | {r['nll']:.5f} | "
                     f"{r['rise']:+.5f} | {rec} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--toys", default="gptq_toy,toy_arith")
    parser.add_argument("--random", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-search"))
    parser.add_argument("--arith-layout", choices=("trained", "bare"), default="trained",
                        help="toy_arith's text: 'Question: q\\nAnswer: a' as trained, or gptq_toy's bare 'q\\na'")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    args.work.mkdir(parents=True, exist_ok=True)
    known = toys(args.work, args.arith_layout)
    results = []
    for name in args.toys.split(","):
        src, calib, heldout = known[name]
        t0 = time.perf_counter()
        results.append(bench_toy(name, src, calib, heldout, args.work, args.random, args.seed))
        results[-1]["wall_s"] = time.perf_counter() - t0
        (args.work / "bench_search.json").write_text(json.dumps(results, indent=1))
        print(f"[{name}] wall {results[-1]['wall_s']:.0f} s", flush=True)
    for r in results:
        print()
        print(table(r))


if __name__ == "__main__":
    main()
