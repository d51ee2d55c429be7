"""Does GPTQ on the MTP layer help the draft? (issue #24, item 3.) Quantize a toy with an MTP layer, every linear in
MXFP4 (recipe all-linear: the MTP layer's attention, shared and routed experts too), three ways:

  rtn          round to nearest everywhere;
  gptq-mtp-rtn GPTQ on the main layers, the MTP layer rounded to nearest (what --method gptq did before);
  gptq         GPTQ on the main layers and on the MTP layer (fed the final-norm hidden states and next-token
               embeddings, as the engines run the draft);

then compare MTP draft acceptance question by question with the eval stage (in process, weights-only emulation,
greedy, toy_arith). `gptq` vs `gptq-mtp-rtn` isolates the MTP layer: same target weights, same generations.

    python scripts/bench_gptq_mtp.py --model M --calib C.jsonl [--limit 200] [--samples 128 --seq-len 256]
        [--compare gptq:gptq-mtp-rtn,gptq:rtn,rtn:bf16,gptq:bf16]

Prints the MTP layer's calibration errors, then one line per comparison; BENCHMARKS.md ("GPTQ on the MTP layer")
records the figures.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mtp_recipe import compare_mtp  # noqa: E402 (beside this script)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--calib", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-gptq-mtp"))
    parser.add_argument("--compare", default="gptq:gptq-mtp-rtn,gptq:rtn,rtn:bf16,gptq:bf16",
                        help="CANDIDATE:BASELINE pairs; gptq:gptq-mtp-rtn isolates the MTP layer's solve (same "
                             "target weights, same generations)")
    args = parser.parse_args(argv)

    import quant.gptq.mtp as mtp
    from quant.gptq import CalibrationSettings, GptqSettings
    from quant.pipeline import quantize_checkpoint

    shutil.rmtree(args.out, ignore_errors=True)
    settings = GptqSettings(CalibrationSettings(str(args.calib), samples=args.samples, seq_len=args.seq_len))
    paths = {"bf16": args.model}
    manifests = {}
    for name in ("rtn", "gptq-mtp-rtn", "gptq"):
        paths[name] = args.out / name
        kw = {} if name == "rtn" else dict(method="gptq", gptq=settings)
        saved = mtp.mtp_layers
        if name == "gptq-mtp-rtn":
            mtp.mtp_layers = lambda ckpt: []  # the MTP layer left to round-to-nearest, as before
        t0 = time.perf_counter()
        try:
            manifests[name] = quantize_checkpoint(args.model, paths[name], recipe="all-linear", check_engines=None,
                                                  log=lambda m: None, **kw)
        finally:
            mtp.mtp_layers = saved
        print(f"{name}: exported in {time.perf_counter() - t0:.1f} s", flush=True)

    import json

    n_layers = json.loads((args.model / "config.json").read_text())["num_hidden_layers"]
    block = f"model.layers.{n_layers}."
    for name in ("gptq-mtp-rtn", "gptq"):
        methods = [r["method"] for n, r in manifests[name]["tensors"].items()
                   if n.startswith(block) and r["action"] == "quantize"]
        solved = [m for m in methods if m["method"] == "gptq"]
        line = f"{name}: MTP layer {block}*: {len(solved)}/{len(methods)} weights GPTQ-solved"
        if solved:
            rtn, gptq = (sum(m[k] for m in solved) for k in ("calib_rel_error_rtn", "calib_rel_error_gptq"))
            line += f"; calibration output error (sum over solved) RTN {rtn:.4f} -> GPTQ {gptq:.4f}"
        print(line, flush=True)


    for pair in args.compare.split(","):
        candidate, baseline = pair.split(":")
        compare_mtp(paths, args, baseline, candidate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
