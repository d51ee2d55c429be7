"""Golden exports (issue #29): the bytes `quantize_checkpoint` writes for every toy x scheme x recipe, and the
findings `quant verify-manifest` reports on a set of broken exports, recorded once so that a refactor which must
not change behaviour can be checked against them.

    python scripts/golden_exports.py --record          # (re)write tests/data/golden_exports.json, every case
    python scripts/golden_exports.py --check           # recompute every case and compare (exit 1 on a difference)
    python scripts/golden_exports.py --check --subset  # only the cases tests/test_export_golden.py runs

A case is a toy (its family file's `toys` in quant/manifests/families, built with seed 0), a source format (bf16, or
the toy's official
block-FP8 release), a scheme, a recipe and a method (rtn; gptq with small calibration settings). Its golden is the
sha256 of every file of the export (shards, index, config.json, model card, tokenizer files...), with the
run-dependent parts taken out first: the source and output paths (replaced by placeholders) and the tool's
version (the manifest's `version`, and the `quant_manifest.json` keys listed in VOLATILE). A combination the tool
refuses (QuantError, or the self-check's EngineFailure) is recorded as refused, with the first line of its
message.

The broken-export set (tests build such defects inline, from synthetic headers; this set is made of a real toy
export): one RTN export of a toy and copies of it with one defect each (config edits, a zeroed scale byte), each
checked by `quant verify-manifest CKPT --engine all --scales --json`; the golden is its exit code and JSON, the
checkpoint path replaced.

Every CPU gives a round-to-nearest export's bytes (integer arithmetic on exactly representable values; the
manifest's error figures are float64 sums recorded to 6 digits), so those cases are compared by sha256. GPTQ's
bytes follow the CPU's float arithmetic (its calibration forward's matmuls round per vector ISA, and each layer's
Hessian is built from the previous layers' quantized outputs), so a GPTQ case is compared by what matters
(GPTQ_TOLERANCE): its float-free files by sha256, its manifest with the float figures taken out by sha256, its
codes and scales against the reference tensors in tests/data/golden_gptq/, and its calibration loss.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "data" / "golden_exports.json"
CALIB = REPO / "evals" / "data" / "toy_arith" / "train.jsonl"
# GPTQ's calibration file as the settings name it (recorded in the manifest and the plan digest): a relative name,
# the file copied into the work directory and the run made from there, so the goldens hold wherever the repo is.
CALIB_NAME = "calib.jsonl"
SRC_TOKEN, OUT_TOKEN, PACKAGE_TOKEN = "<SRC>", "<OUT>", "<QUANT>"
# Keys of quant_manifest.json and .quant-complete taken out before hashing. Two runs of the same export differ only
# in the source path (manifest `source.checkpoint`, replaced by SRC_TOKEN; the card names the source directory's
# base name, the same in every run here); the timings are in the manifest quantize_checkpoint returns, never in
# the file. The version is taken out so that a release bump is no golden change.
VOLATILE = ("version",)
# Dot-files hashed too: the completion marker holds the plan digest (what a resumed run compares) and the card's
# hash. The owner file (quant.ownership: the source path and the files written) and the progress records (the
# manifest's records again) are not.
HASHED_DOT_FILES = (".quant-complete",)
GPTQ_TOYS = ("qwen3-moe", "glm5")  # GPTQ cases: one per family kind (plain MoE; DeepSeek-style with MTP)
GPTQ_REFERENCES = REPO / "tests" / "data" / "golden_gptq"
# Measured between AVX2 and AVX-512 on one Xeon (4th gen, AMX), the glm5 all-linear case: 1.05% of the codes, 41 of
# 49,056 scale bytes (each one E8M0 step) and 0.3% of the calibration loss differ; the first layer's bf16 matmul
# rounds differently and every later layer calibrates on those outputs.
GPTQ_TOLERANCE = {"codes_agree": 0.98, "scales_agree": 0.995, "scale_steps": 1, "loss_rel": 0.02}
# The files of a GPTQ export whose bytes hold float results (the shards, the manifest's and card's error figures).
GPTQ_FLOAT_FILES = ("README.md", "quant_manifest.json", ".quant-complete")
# Manifest keys holding float results of a GPTQ run, taken out before its structural hash: the error figures, the
# shards' digests, and the calibration tokens each expert was routed (the router's float scores pick them; `why`
# repeats the count). Which method each module got stays in.
GPTQ_FLOAT_KEYS = ("rel_mse", "sqnr_db", "calib_rel_error_gptq", "calib_rel_error_rtn", "damping", "worst_rel_mse",
                   "sha256", "output_bytes", "tokens", "why")
BROKEN_TOY = "glm5"


def _environment() -> None:
    """As tests/conftest.py: offline, and compiled-kernel packages a developer built never decide the code path."""
    os.environ.setdefault("QUANT_CACHE_DIR", tempfile.mkdtemp(prefix="quant-golden-cache-"))
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(key, "1")

def _planning():
    """(builtin_recipes, MXFP4_SCHEMES, SCHEMES), from quant.planning, or quant.pipeline before issue #29 moved
    them (to --record from an earlier commit)."""
    try:
        from quant.planning.recipes import builtin_recipes
        from quant.planning.schemes import MXFP4_SCHEMES, SCHEMES
    except ImportError:
        from quant.pipeline.recipes import builtin_recipes
        from quant.pipeline.schemes import MXFP4_SCHEMES, SCHEMES
    return builtin_recipes, MXFP4_SCHEMES, SCHEMES


def case_id(toy: str, source: str, scheme: str, recipe: str, method: str) -> str:
    return f"{toy}/{source}/{scheme}/{recipe}/{method}"


def all_cases() -> list[dict]:
    """Every case: each toy x {bf16 source} x scheme x recipe with RTN; each toy's block-FP8 source x scheme with
    the default recipe; GPTQ on GPTQ_TOYS (bf16 source, both MXFP4 schemes, two recipes)."""
    from quant.toy import TOY_NAMES, toy_family

    builtin_recipes, MXFP4_SCHEMES, SCHEMES = _planning()

    cases = []
    for toy in TOY_NAMES:
        for scheme in SCHEMES:
            for recipe in builtin_recipes()["recipes"]:
                cases.append(dict(toy=toy, source="bf16", scheme=scheme, recipe=recipe, method="rtn"))
        family = toy_family(toy)
        # a layout toy (Kimi-K3) or a toy stored as its release (MiniMax-M3.1-Flash): --fp8-block is refused
        if family.config_class is None or family.release_format:
            continue
        for scheme in SCHEMES:
            cases.append(dict(toy=toy, source="fp8", scheme=scheme, recipe="experts-only", method="rtn"))
    for toy in GPTQ_TOYS:
        for scheme in MXFP4_SCHEMES:
            for recipe in ("experts-only", "all-linear"):
                cases.append(dict(toy=toy, source="bf16", scheme=scheme, recipe=recipe, method="gptq"))
    for c in cases:
        c["id"] = case_id(**c)
    return cases


def subset(cases: list[dict]) -> list[dict]:
    """What `make test` runs: every toy once, every scheme, recipe, source format and method at least once, and
    per toy the combination most of its code paths take (all-linear: every role quantized)."""
    from quant.toy import TOY_NAMES

    builtin_recipes, _, SCHEMES = _planning()

    schemes, recipes = list(SCHEMES), list(builtin_recipes()["recipes"])
    chosen = set()
    for i, toy in enumerate(TOY_NAMES):
        chosen.add(case_id(toy, "bf16", schemes[i % len(schemes)], "all-linear", "rtn"))
        chosen.add(case_id(toy, "bf16", schemes[(i + 1) % len(schemes)], recipes[i % len(recipes)], "rtn"))
    chosen.add(case_id("deepseek-v3", "fp8", "fp8-block", "experts-only", "rtn"))
    chosen.add(case_id("qwen3.5", "fp8", "w_mxfp4_a_mxfp4", "experts-only", "rtn"))
    chosen.add(case_id("glm5", "bf16", "w_mxfp4_a_mxfp4", "all-linear", "gptq"))
    chosen.add(case_id("qwen3-moe", "bf16", "w_mxfp4", "experts-only", "gptq"))
    # DeepSeek-V4's native MXFP4 experts carried over (issue #31); its all-linear exports are refused today (the
    # indexer's weights_proj is quantized, the engines build it unquantized), so the rotation above finds none.
    chosen.add(case_id("deepseek-v4", "bf16", "w_mxfp4_a_mxfp4", "experts-only", "rtn"))
    picked = [c for c in cases if c["id"] in chosen]
    assert len(picked) == len(chosen), sorted(chosen - {c["id"] for c in picked})
    return picked


def _normalized(data: bytes, src: Path, out: Path) -> bytes:
    """The paths of this run (output, source, and the package's own directory, which messages naming a family
    file show) replaced by placeholders."""
    import quant

    package = Path(quant.__file__).resolve().parent
    for path, token in ((out, OUT_TOKEN), (src, SRC_TOKEN), (package, PACKAGE_TOKEN)):
        data = data.replace(str(path).encode(), token.encode())
    return data


def export_hashes(src: Path, out: Path) -> dict[str, str]:
    """sha256 of every published file of the export `out` (dot-files, the tool's own bookkeeping, aside), the
    paths and the version taken out first."""
    from quant import __version__

    hashes = {}
    for f in sorted(out.iterdir()):
        if not f.is_file() or (f.name.startswith(".") and f.name not in HASHED_DOT_FILES):
            continue
        data = f.read_bytes()
        if f.name in ("quant_manifest.json", ".quant-complete"):
            manifest = json.loads(data)
            for key in VOLATILE:
                manifest.pop(key, None)
            data = json.dumps(manifest, indent=1, sort_keys=True).encode()  # the published manifest's own layout
        data = _normalized(data, src, out).replace(f"moe-quant {__version__}".encode(), b"moe-quant <VERSION>")
        hashes[f.name] = hashlib.sha256(data).hexdigest()
    return hashes


def _gptq_settings():
    from quant.gptq import CalibrationSettings, GptqSettings

    return GptqSettings(CalibrationSettings(CALIB_NAME, samples=4, seq_len=32), batch=4)


def run_case(case: dict, sources: dict[tuple[str, str], Path], work: Path) -> dict:
    """{"files": {name: sha256}} of the case's export, or {"refused": first line of the error}."""
    from quant.errors import EngineFailure, QuantError
    from quant.pipeline import quantize_checkpoint

    src = sources[(case["toy"], case["source"])]
    out = work / case["id"].replace("/", "__")
    kwargs = dict(scheme=case["scheme"], recipe=case["recipe"], progress=False, log=lambda m: None)
    if case["method"] == "gptq":
        kwargs.update(method="gptq", gptq=_gptq_settings())
        shutil.copyfile(CALIB, work / CALIB_NAME)
    cwd = os.getcwd()
    os.chdir(work)
    try:
        quantize_checkpoint(src, out, **kwargs)
    except (QuantError, EngineFailure) as e:
        return {"refused": _normalized(str(e).splitlines()[0].encode(), src, out).decode()}
    finally:
        os.chdir(cwd)
    try:
        files = export_hashes(src, out)
        if case["method"] != "gptq":
            return {"files": files}
        shards = [n for n in files if n.endswith(".safetensors")]
        return {"files": {n: h for n, h in files.items() if n not in shards and n not in GPTQ_FLOAT_FILES},
                "gptq": gptq_summary(src, out)}
    finally:
        shutil.rmtree(out, ignore_errors=True)


# -- GPTQ cases: compared by what matters ---------------------------------------------------------------------

def _strip_floats(value):
    if isinstance(value, dict):
        return {k: _strip_floats(v) for k, v in value.items() if k not in GPTQ_FLOAT_KEYS}
    if isinstance(value, list):
        return [_strip_floats(v) for v in value]
    return value


def _quantized_tensors(out: Path) -> dict:
    """The export's U8 tensors (MXFP4 codes and E8M0 scales), by name."""
    import torch
    from safetensors.torch import load_file

    tensors = {}
    for shard in sorted(out.glob("*.safetensors")):
        tensors.update({k: v for k, v in load_file(str(shard)).items() if v.dtype == torch.uint8})
    return tensors


def _tensors_digest(tensors: dict) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode() + b"\0" + tensors[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


def gptq_summary(src: Path, out: Path) -> dict:
    """A GPTQ export as compared across CPUs: its manifest without float figures (sha256), its calibration loss (the
    sum of the per-module relative output errors GPTQ reached) and its codes and scales (digest; the tensors are
    kept in _GPTQ_TENSORS for the comparison and for --record)."""
    manifest = json.loads((out / "quant_manifest.json").read_text())
    for key in VOLATILE:
        manifest.pop(key, None)
    loss = sum(r["method"]["calib_rel_error_gptq"] for r in manifest["tensors"].values()
               if isinstance(r.get("method"), dict) and "calib_rel_error_gptq" in r["method"])
    structure = _normalized(json.dumps(_strip_floats(manifest), sort_keys=True).encode(), src, out)
    tensors = _quantized_tensors(out)
    digest = _tensors_digest(tensors)
    _GPTQ_TENSORS[digest] = tensors
    return {"manifest": hashlib.sha256(structure).hexdigest(), "loss": round(loss, 6), "tensors": digest[:16]}


_GPTQ_TENSORS: dict[str, dict] = {}


def reference_path(digest: str) -> Path:
    return GPTQ_REFERENCES / f"{digest[:16]}.safetensors"


def write_references(result: dict) -> None:
    """--record: the reference codes and scales of every GPTQ case (one file per distinct set; stale ones removed)."""
    from safetensors.torch import save_file

    GPTQ_REFERENCES.mkdir(parents=True, exist_ok=True)
    wanted = {r["gptq"]["tensors"] for r in result["exports"].values() if "gptq" in r}
    for digest, tensors in _GPTQ_TENSORS.items():
        if digest[:16] in wanted and not reference_path(digest).exists():
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(reference_path(digest)))
    for stale in GPTQ_REFERENCES.glob("*.safetensors"):
        if stale.stem not in wanted:
            stale.unlink()


def agreement(reference: dict, got: dict) -> dict:
    """Shares of equal MXFP4 codes (4-bit values) and equal scale bytes, and the largest scale difference in E8M0
    steps, of `got` against `reference` (same names and shapes)."""
    codes = codes_equal = scales = scales_equal = steps = 0
    for name, ref in reference.items():
        t = got[name]
        if name.endswith("_scale"):
            diff = (ref.int() - t.int()).abs()
            scales, scales_equal = scales + diff.numel(), scales_equal + int((diff == 0).sum())
            steps = max(steps, int(diff.max()) if diff.numel() else 0)
        else:
            codes += 2 * ref.numel()
            codes_equal += int(((ref & 15) == (t & 15)).sum() + ((ref >> 4) == (t >> 4)).sum())
    return {"codes_agree": codes_equal / max(1, codes), "scales_agree": scales_equal / max(1, scales),
            "scale_steps": steps}


def gptq_differences(cid: str, want: dict, got: dict) -> list[str]:
    out = []
    if want["manifest"] != got["manifest"]:
        out.append(f"{cid}: quant_manifest.json differs beyond its float figures")
    if abs(got["loss"] - want["loss"]) > GPTQ_TOLERANCE["loss_rel"] * want["loss"]:
        out.append(f"{cid}: calibration loss {got['loss']} vs {want['loss']} (over "
                   f"{GPTQ_TOLERANCE['loss_rel']:.0%} apart)")
    if want["tensors"] == got["tensors"]:
        return out
    from safetensors.torch import load_file

    path = GPTQ_REFERENCES / f"{want['tensors']}.safetensors"
    if not path.is_file():
        return [*out, f"{cid}: no reference tensors {path.name} (record the goldens)"]
    reference = load_file(str(path))
    tensors = next(t for d, t in _GPTQ_TENSORS.items() if d.startswith(got["tensors"]))
    if set(reference) != set(tensors) or any(reference[n].shape != tensors[n].shape for n in reference):
        return [*out, f"{cid}: its quantized tensors' names or shapes differ from {path.name}"]
    seen = agreement(reference, tensors)
    tol = GPTQ_TOLERANCE
    if seen["codes_agree"] < tol["codes_agree"] or seen["scales_agree"] < tol["scales_agree"] \
            or seen["scale_steps"] > tol["scale_steps"]:
        out.append(f"{cid}: codes agree {seen['codes_agree']:.4%} (at least {tol['codes_agree']:.1%}), scales "
                   f"{seen['scales_agree']:.4%} (at least {tol['scales_agree']:.1%}), largest scale difference "
                   f"{seen['scale_steps']} E8M0 step(s) (at most {tol['scale_steps']})")
    return out


def build_sources(cases: list[dict], root: Path) -> dict[tuple[str, str], Path]:
    from quant.toy import build_toy

    sources = {}
    for key in dict.fromkeys((c["toy"], c["source"]) for c in cases):
        toy, source = key
        sources[key] = build_toy(toy, root / f"{toy}-{source}", fp8_block=source == "fp8", seed=0)
    return sources


# -- the broken-export set ------------------------------------------------------------------------------------

def _edit_config(ckpt: Path, edit) -> None:
    path = ckpt / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config, indent=2))


def _drop_eh_proj_excludes(config: dict) -> None:
    q = config["quantization_config"]
    q["exclude"] = [e for e in q["exclude"] if "eh_proj" not in e]


def _zero_first_expert_scale(ckpt: Path) -> None:
    """Scale byte 0x00 in the first routed expert's weight_scale (E8M0 2^-127: what --scales flags)."""
    from safetensors.torch import load_file, save_file

    for shard in sorted(ckpt.glob("*.safetensors")):
        tensors = load_file(str(shard))
        name = next((n for n in sorted(tensors) if ".experts.0." in n and n.endswith("weight_scale")), None)
        if name:
            tensors[name] = tensors[name].clone()
            tensors[name].view(-1)[0] = 0
            save_file(tensors, str(shard), metadata={"format": "pt"})
            return
    raise AssertionError(f"{ckpt}: no routed expert weight_scale")


BROKEN = {
    "clean": None,
    "no_export_key": lambda ckpt: _edit_config(ckpt, lambda c: c["quantization_config"].pop("export")),
    "no_exclude": lambda ckpt: _edit_config(ckpt, lambda c: c["quantization_config"].pop("exclude")),
    "eh_proj_excludes_dropped": lambda ckpt: _edit_config(ckpt, _drop_eh_proj_excludes),
    "weight_only_global": lambda ckpt: _edit_config(
        ckpt, lambda c: c["quantization_config"]["global_quant_config"].update(input_tensors=None)),
    "declared_mtp_missing": lambda ckpt: _edit_config(ckpt, lambda c: c.update(num_nextn_predict_layers=2)),
    "zero_scale_byte": _zero_first_expert_scale,
}
VERIFY_ARGS = ("--engine", "all", "--scales", "--json")


def broken_findings(root: Path) -> dict[str, dict]:
    """`quant verify-manifest CKPT --engine all --scales --json` on each export of the broken set: its exit code
    and JSON (the checkpoint path replaced)."""
    from typer.testing import CliRunner

    from quant.cli import app
    from quant.pipeline import quantize_checkpoint
    from quant.toy import build_toy

    src = build_toy(BROKEN_TOY, root / "broken-src", seed=0)
    base = root / "broken-base"
    quantize_checkpoint(src, base, recipe="all-linear", check_engines=None, log=lambda m: None)
    results = {}
    for name, defect in BROKEN.items():
        ckpt = root / f"broken-{name}"
        shutil.copytree(base, ckpt)
        if defect is not None:
            defect(ckpt)
        run = CliRunner().invoke(app, ["verify-manifest", str(ckpt), *VERIFY_ARGS])
        if run.exception and not isinstance(run.exception, SystemExit):
            raise run.exception
        results[name] = {"exit_code": run.exit_code,
                         "json": json.loads(_normalized(run.stdout.encode(), src, ckpt).decode())}
        shutil.rmtree(ckpt)
    return results


# -- record / check -----------------------------------------------------------------------------------------

# The intra-op threads the goldens were recorded with: GPTQ's calibration statistics in the manifest (not the
# weights) round differently with the thread count, and pytest's xdist workers run on one thread (conftest.py).
THREADS = 2


def compute(cases: list[dict], work: Path, broken: bool = True, log=print) -> dict:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return _compute(cases, work, broken, log)
    finally:
        torch.set_num_threads(threads)


def _compute(cases: list[dict], work: Path, broken: bool, log) -> dict:
    sources = build_sources(cases, work / "sources")
    exports = {}
    for case in cases:
        t0 = time.perf_counter()
        exports[case["id"]] = run_case(case, sources, work)
        log(f"{case['id']}: {'refused' if 'refused' in exports[case['id']] else 'ok'} "
            f"({time.perf_counter() - t0:.1f} s)")
    result = {"exports": exports}
    if broken:
        result["verify_broken"] = broken_findings(work)
    return result


def differences(expected: dict, actual: dict) -> list[str]:
    """Human-readable differences of `actual` from `expected` (only the cases and sets `actual` holds)."""
    out = []
    for cid, got in actual.get("exports", {}).items():
        want = expected.get("exports", {}).get(cid)
        if want is None:
            out.append(f"{cid}: no golden recorded")
        elif "refused" in want or "refused" in got:
            if want != got:
                out.append(f"{cid}: expected {want}, got {got}")
        else:
            if "gptq" in want or "gptq" in got:
                out += gptq_differences(cid, want.get("gptq") or {}, got.get("gptq") or {}) \
                    if "gptq" in want and "gptq" in got else [f"{cid}: compared as GPTQ on one side only"]
            for name in sorted(set(want["files"]) | set(got["files"])):
                if want["files"].get(name) != got["files"].get(name):
                    out.append(f"{cid}: {name}: expected {want['files'].get(name)}, got {got['files'].get(name)}")
    if "verify_broken" in actual:
        for name, got in actual["verify_broken"].items():
            if expected.get("verify_broken", {}).get(name) != got:
                out.append(f"verify_broken/{name}: findings differ")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", action="store_true", help=f"recompute every case and write {GOLDEN.name}")
    mode.add_argument("--check", action="store_true", help="recompute and compare with the recorded goldens")
    parser.add_argument("--subset", action="store_true", help="only the cases tests/test_export_golden.py runs")
    parser.add_argument("--only", help="only the cases whose id contains this text")
    parser.add_argument("--golden", type=Path, default=GOLDEN)
    parser.add_argument("--out", type=Path, help="--check: also write what was computed here (to diff two runs)")
    args = parser.parse_args(argv)
    _environment()
    cases = all_cases()
    if args.subset:
        cases = subset(cases)
    if args.only:
        cases = [c for c in cases if args.only in c["id"]]
    with tempfile.TemporaryDirectory(prefix="golden-exports-") as tmp:
        result = compute(cases, Path(tmp), broken=not args.only)
    if args.record:
        if args.subset or args.only:
            parser.error("--record writes every case: no --subset or --only")
        args.golden.parent.mkdir(parents=True, exist_ok=True)
        args.golden.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
        write_references(result)
        refused = sum("refused" in r for r in result["exports"].values())
        print(f"recorded {len(result['exports'])} exports ({refused} refused) and "
              f"{len(result['verify_broken'])} broken-set reports in {args.golden}")
        return 0
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    diffs = differences(json.loads(args.golden.read_text()), result)
    for line in diffs:
        print(line)
    print(f"{len(result['exports'])} exports checked: {'ok' if not diffs else f'{len(diffs)} difference(s)'}")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
