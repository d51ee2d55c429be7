"""Golden exports (issue #29): the bytes `quantize_checkpoint` writes for every toy x scheme x recipe, and the
findings `quant verify-manifest` reports on a set of broken exports, recorded once so that a refactor which must
not change behaviour can be checked against them.

    python scripts/golden_exports.py --record          # (re)write tests/data/golden_exports.json, every case
    python scripts/golden_exports.py --check           # recompute every case and compare (exit 1 on a difference)
    python scripts/golden_exports.py --check --subset  # only the cases tests/test_export_golden.py runs

A case is a toy (its family file's `toys` in quant/manifests/families, built with seed 0), a source format (bf16, or the toy's official
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
# The ATen CPU capability the GPTQ goldens were recorded with (ATEN_CPU_CAPABILITY, set before torch loads, here and
# by tests/conftest.py): GPTQ's layer forward reduces in an ISA-dependent order, so its exports differ between AVX2
# and AVX-512 machines; round-to-nearest exports are the same bytes on every ISA (tests/test_numerics_isa.py).
GPTQ_ISA = "avx2"
GPTQ_TOYS = ("qwen3-moe", "glm5")  # GPTQ cases: one per family kind (plain MoE; DeepSeek-style with MTP)
BROKEN_TOY = "glm5"


def _environment() -> None:
    """As tests/conftest.py: offline, and compiled-kernel packages a developer built never decide the code path."""
    os.environ.setdefault("QUANT_CACHE_DIR", tempfile.mkdtemp(prefix="quant-golden-cache-"))
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(key, "1")
    if os.path.exists("/proc/cpuinfo") and " avx2" in open("/proc/cpuinfo").read():
        os.environ.setdefault("ATEN_CPU_CAPABILITY", GPTQ_ISA)


def gptq_comparable() -> bool:
    """Whether this process computes GPTQ on the ISA its goldens were recorded with (else only RTN cases compare:
    an aarch64 machine, or ATEN_CPU_CAPABILITY set otherwise)."""
    import torch

    return torch.backends.cpu.get_cpu_capability().lower() == GPTQ_ISA

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
        return {"files": export_hashes(src, out)}
    finally:
        shutil.rmtree(out, ignore_errors=True)


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
    if not gptq_comparable():
        if args.record:
            parser.error(f"--record needs ATen's {GPTQ_ISA} kernels (the GPTQ goldens' ISA); this machine runs "
                         f"another: record on an x86_64 machine")
        print(f"note: GPTQ cases not compared (recorded on {GPTQ_ISA}, this process computes on another ISA)")
        cases = [c for c in cases if c["method"] != "gptq"]
    with tempfile.TemporaryDirectory(prefix="golden-exports-") as tmp:
        result = compute(cases, Path(tmp), broken=not args.only)
    if args.record:
        if args.subset or args.only:
            parser.error("--record writes every case: no --subset or --only")
        args.golden.parent.mkdir(parents=True, exist_ok=True)
        args.golden.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
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
