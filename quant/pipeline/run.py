"""`quantize_checkpoint`: read → validate → plan → [solve, with --method gptq's solver] → quantize → write →
stage → self-check → publish, streaming one shard (GPTQ: one decoder layer) at a time.

Output layout: quantized shards, model.safetensors.index.json, config.json with the quantization_config,
tokenizer/generation files, quant_manifest.json (per-tensor audit), README.md (model card) and
`.quant-complete`. How OUT is held, staged and published (so an interrupted or failed output never looks like a
finished checkpoint) is `quant.pipeline.output`; this module decides what goes into it.
"""

from __future__ import annotations

import contextlib
import fnmatch
import itertools
import json
import math
import re
import shutil
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from quant import __version__
from quant.checkpoint import DTYPE_BYTES, INDEX_FILE, open_checkpoint
from quant.engines import exclude_aliases, newest, select_profiles, unexpanded_fused_name
from quant.errors import EngineFailure, QuantError, did_you_mean
from quant.files import sha256_bytes, write_atomic
from quant.hub import hub_reference, open_hub_checkpoint
from quant.numerics import SCALE_MODES
from quant.pipeline import execute
from quant.pipeline.model_card import CARD_FILE, accuracy_of, render_card, replace_accuracy, without_accuracy
from quant.pipeline.output import COMPLETE_MARKER, GPTQ_DIR, MANIFEST_FILE, RECIPE_FILE, Output, read_record, side_files
from quant.pipeline.quark_config import official_fp8_config, quark_quantization_config
from quant.pipeline.shard_records import ShardResult, completed
from quant.pipeline.sidecars import sidecar_files_present, sidecar_index, sidecar_records
from quant.pipeline.snapshot import cached_source
from quant.pipeline.solver import SolveRequest, WeightSolver
from quant.pipeline.source_files import (
    HubChanges,
    HubFiles,
    LocalChanges,
    LocalFiles,
    check_disk,
    side_file_names,
    source_reference,
    streamed_reference,
)
from quant.planning.plan import Plan, ShardJob, make_plan
from quant.planning.recipes import family_for_config, load_recipe
from quant.planning.schemes import DEFAULT_SCHEME, MXFP4_SCHEMES, get_scheme, scheme_name
from quant.process import auto_devices, cpu_threads, frozen_imports, set_threads, visible_accelerators
from quant.validate import require_loadable_drafts, require_sound_scales, require_valid
from quant.verify import verify_checkpoint
from quant.verify.scales import scan_scales

LAYER_PREFIX = re.compile(r"^.*?layers\.\d+\.")


def parse_devices(devices: str | list[str] | None, workers: int) -> list[str]:
    if devices is None or devices == "auto":
        return auto_devices(workers, visible_accelerators())
    import torch

    items = [d.strip() for d in devices.split(",")] if isinstance(devices, str) else list(devices)
    for d in items:
        if d.startswith("cuda") and not torch.cuda.is_available():
            raise QuantError(f"--devices {d}: CUDA is not available on this machine")
        try:
            torch.device(d)
        except RuntimeError:
            raise QuantError(f"--devices: {d!r} is not a torch device") from None
    return items


def secondary_patterns(plan: Plan, config: dict) -> dict[str, str]:
    """Glob patterns for modules whose scheme differs from the primary one (layer_quant_config keys).
    A pattern drops the layer prefix ("*self_attn.o_proj") so it also matches SGLang's MTP runtime names; a
    shard some engine looks up by its fused name (engines.unexpanded_fused_name) gets that name's pattern too.
    Where modules of one name take different schemes in different layers (a recipe's `modules`, what `quant
    search` writes), each such module gets keys of its own instead: every name an engine builds it under."""

    schemes_of_name: dict[str, set[str]] = {}
    for module, scheme in plan.quantized.items():
        schemes_of_name.setdefault(LAYER_PREFIX.sub("", module), set()).add(scheme)
    patterns = {}
    for module, scheme in plan.quantized.items():
        if scheme == plan.scheme.name:
            continue
        if len(schemes_of_name[LAYER_PREFIX.sub("", module)]) > 1:
            patterns.update(dict.fromkeys(per_module_keys(module, config), scheme))
            continue
        patterns["*" + LAYER_PREFIX.sub("", module)] = scheme
        fused = unexpanded_fused_name(module, config)
        if fused is not None:
            patterns["*" + LAYER_PREFIX.sub("", fused)] = scheme
        for moe in fused_moe_names(exclude_aliases(module, config)):  # MiniMax's block_sparse_moe, built as mlp
            patterns["*" + LAYER_PREFIX.sub("", moe)] = scheme
    for module, scheme in plan.quantized.items():
        if scheme == plan.scheme.name:
            hit = next((p for p in patterns if fnmatch.fnmatchcase(module, p) or ("*" not in p and p in module)),
                       None)
            if hit:
                raise QuantError(f"recipe {plan.recipe['name']!r}: {module} is {scheme} but pattern {hit} "
                                 f"puts modules of the same name in other layers in {patterns[hit]}")
    return patterns


ROUTED_EXPERT = re.compile(r"^(?P<moe>.*\.experts)\.\d+\.[^.]+$")


def fused_moe_names(names: list[str]) -> list[str]:
    """The FusedMoE prefix of each routed expert's name in `names`: what the engines look a FusedMoE's config up
    by, never an expert's leaf."""
    return [m.group("moe") for name in names if (m := ROUTED_EXPERT.match(name))]


def per_module_keys(module: str, config: dict) -> list[str]:
    """The layer_quant_config keys of one module: its names under every engine (exact names: both engines fnmatch
    the keys, vLLM also takes a key that is a substring of the name), its fused name where an engine looks that up,
    and for a routed expert its MoE's prefix, which the engines look a FusedMoE's config up by."""

    names = list(exclude_aliases(module, config))
    fused = unexpanded_fused_name(module, config)
    if fused is not None:
        names += exclude_aliases(fused, config)
    return list(dict.fromkeys(names + fused_moe_names(names)))


def render_exclude(plan: Plan, config: dict) -> list[str]:
    entries: list[str] = []
    seen = set()
    for module in plan.kept_modules:
        for name in exclude_aliases(module, config):
            if name not in seen:
                seen.add(name)
                entries.append(name)
    return entries


def quantization_config(plan: Plan, config: dict) -> dict:
    if plan.scheme.output_format == "fp8-official":
        return official_fp8_config(sorted(plan.kept_modules))
    return quark_quantization_config(plan.scheme.name, plan.scale_mode, render_exclude(plan, config),
                                     secondary_patterns(plan, config))


def copy_files(src: Path, output: Output, names: list[str]) -> list[str]:
    """Copy `names` from the source into OUT byte for byte, recorded as ours as soon as they are copied: the side
    files (tokenizer, generation config, chat template...) and the family's sidecar files (a separate draft)."""
    output.tmp_dir.mkdir(exist_ok=True)
    for name in names:  # through OUT's scratch directory: a run killed mid-copy leaves no half file under `name`
        partial = output.tmp_dir / f"copy-{name}"
        shutil.copy2(src / name, partial)
        output.place(name, partial)
    return names


def stage_outputs(output: Output, plan: Plan, src_config: dict, src: Path, results: list[ShardResult],
                  source_ref: str, devices: list[str] | None = None, earlier_card: str | None = None,
                  checked_engines: list[str] | None = None, recipe_file: Path | None = None) -> dict:
    """Copy the side files into OUT and stage the final files (index, manifest, model card, config.json); they
    are published only after the self-check (`Output.publish`). Returns the manifest."""
    weight_map = {name: r.file for r in results for name in r.tensors}
    total = sum(r.bytes for r in results)
    side = copy_files(src, output, side_files(src))
    drafts = copy_files(src, output, sidecar_files_present(plan.family, src_config,
                                                           lambda name: (Path(src) / name).is_file()))  # weights
    draft_map, draft_bytes = sidecar_index(output.root, drafts)
    output.stage(INDEX_FILE, json.dumps({"metadata": {"total_size": total + draft_bytes},
                                         "weight_map": dict(sorted({**weight_map, **draft_map}.items()))},
                                        indent=2))
    config = {k: v for k, v in src_config.items() if k != "quantization_config"}
    config["quantization_config"] = quantization_config(plan, src_config)
    manifest = {
        "tool": "moe-quant", "version": __version__, "settings": plan.settings, "recipe": plan.recipe,
        "source": {"checkpoint": source_ref, "format": plan.source_format,
                   "shards": {r.source_file: {"sha256": r.source_sha256} for r in results}},
        "output": {"shards": {r.file: {"sha256": r.sha256, "bytes": r.bytes} for r in results},
                   "copied_files": side + drafts},
        "mtp_layers": plan.mtp_layers,
        "run": {"devices": list(devices or [])},
        "engines": {"checked": list(checked_engines or []), "scheme_loads_in": list(plan.scheme.engines)},
        "kept_bf16": plan.kept_modules,
        "exclude": config["quantization_config"].get("exclude",
                                                     config["quantization_config"].get("modules_to_not_convert")),
        "summary": summarize(results, plan.linear_params).to_json(),  # written with the manifest, below
        "tensors": {name: rec for r in results for name, rec in r.records.items()},
    }
    sidecars = sidecar_records(plan.family, src_config, output.root, weight_map, output.sha256)
    if sidecars:  # only where the family declares some and the config names them (other manifests unchanged)
        manifest["sidecars"] = sidecars
    if recipe_file is not None:  # a user's recipe, saved beside the card whose reproduce line names it
        output.stage(RECIPE_FILE, Path(recipe_file).read_bytes())
        manifest["recipe_file"] = RECIPE_FILE
    stage_record(output, manifest, config, src, source_ref, earlier_card)
    output.stage("config.json", json.dumps(config, indent=2))
    return manifest


def stage_record(output: Output, manifest: dict, config: dict, src: Path, source_ref: str,
                 earlier_card: str | None) -> None:
    """Stage the manifest and the model card rendered from it (again after the self-check, which adds what it
    checked and which releases refuse the export)."""
    output.stage(MANIFEST_FILE, json.dumps(manifest, indent=1, sort_keys=True))
    source_card = src / CARD_FILE
    card = render_card(manifest, config, source_ref,
                       source_card.read_text(errors="replace") if source_card.is_file() else None)
    if earlier_card is not None:  # the accuracy section `quant eval --card` wrote for these same weights
        card = replace_accuracy(card, earlier_card)
    output.stage(CARD_FILE, card)


def kept_card_parts(out: Path) -> str | None:
    """Before an earlier export in OUT is redone: the accuracy section `quant eval --card` filled into its model
    card (returned, to carry over when the weights stay the same). The card is ours as recorded (a card edited by
    hand was refused when the run took OUT: quant.ownership)."""
    card_path = out / CARD_FILE
    marker = read_record(out / COMPLETE_MARKER)
    if not card_path.is_file() or not isinstance(marker, dict):
        return None
    return accuracy_of(card_path.read_text(errors="replace"))


@dataclass(frozen=True)
class WorstError:
    """The quantized module with the largest relative MSE against its source."""

    module: str
    rel_mse: float


@dataclass(frozen=True)
class ExportSummary:
    """What an export holds, in brief: modules per treatment (scheme, or action when kept), the worst quantization
    error and the shards' bytes. The manifest's "summary" is its JSON form (`to_json`, where the manifest is
    written); `of_manifest` reads it back from a manifest (quantize_checkpoint's result, quant_manifest.json)."""

    modules_by_treatment: dict[str, int]
    worst: WorstError | None
    output_bytes: int
    effective_bits: float | None = None  # stored bits per parameter of the linears a recipe could quantize

    def to_json(self) -> dict:
        worst = {"module": self.worst.module, "rel_mse": self.worst.rel_mse} if self.worst else None
        return {"modules_by_treatment": dict(self.modules_by_treatment), "worst_rel_mse": worst,
                "output_bytes": self.output_bytes, "effective_bits": self.effective_bits}

    @classmethod
    def of_manifest(cls, manifest: dict) -> "ExportSummary":
        data = manifest["summary"]
        worst = data["worst_rel_mse"]
        return cls(modules_by_treatment=dict(data["modules_by_treatment"]),
                   worst=WorstError(worst["module"], worst["rel_mse"]) if worst else None,
                   output_bytes=data["output_bytes"], effective_bits=data.get("effective_bits"))


def effective_bits(records: dict[str, dict], linear_params: dict[str, int]) -> float | None:
    """Stored bits (values and scales, as written) per parameter of the linears a recipe could quantize: BF16 is 16,
    MXFP4 4.25 (4 + one 8-bit scale per 32), MXFP8 8.25, per-channel FP8 8 + 32 / in_features."""
    bits = params = 0
    for module, count in linear_params.items():
        record = records.get(module) or records.get(module + ".weight")
        if record is None:
            continue
        bits += sum(8 * DTYPE_BYTES[o["dtype"]] * math.prod(o["shape"]) for o in record["outputs"].values())
        params += count
    return round(bits / params, 4) if params else None


def summarize(results: list[ShardResult], linear_params: dict[str, int] | None = None) -> ExportSummary:
    counts: dict[str, int] = {}
    worst = None
    for r in results:
        for name, rec in r.records.items():
            key = rec.get("scheme") or rec["action"]
            counts[key] = counts.get(key, 0) + 1
            if "rel_mse" in rec and (worst is None or rec["rel_mse"] > worst.rel_mse):
                worst = WorstError(name, rec["rel_mse"])
    records = {name: rec for r in results for name, rec in r.records.items()}
    return ExportSummary(modules_by_treatment=counts, worst=worst, output_bytes=sum(r.bytes for r in results),
                         effective_bits=effective_bits(records, linear_params or {}))


def scale_check(out: Path, metadata_dir: Path | None = None) -> None:
    """Every scale the export wrote is one an engine can use (quant.verify.scales: no E8M0 0x00/0xFF expert or
    block, no zero/inf/NaN FP8 scale): run on every export, whatever --check-engines says."""

    errors = [f for f in scan_scales(out, metadata_dir) if f.severity == "error"]
    if errors:
        raise EngineFailure(f"{out}: self-check failed, {len(errors)} scale error(s), nothing published; first: "
                            f"{errors[0].message}")


def self_check(out: Path, engines: list[str], metadata_dir: Path | None = None, log=print) -> dict:
    """The preflight of the staged export for `engines` (the releases verify-manifest checks by default: quant.verify
    .readable_profiles). An error in an engine's newest profiled release, or one no release escapes, fails it
    (EngineFailure, nothing published). An older release that refuses the export is named, with its first reason,
    in a line and in the manifest (`engines.refused_by`): the export is published, and `quant verify-manifest`
    reports the same releases. Returns the manifest's `engines` record: checked, refused_by."""

    report = verify_checkpoint(out, engines=engines, metadata_dir=metadata_dir, named=set())
    current = {p.label for p in select_profiles(report.profiles) if newest(p)}
    blocking = [f for f in report.errors
                if f.engine == "all" or any(f"{f.engine}=={v}" in current for v in f.versions)]
    if blocking:
        first = blocking[0]
        raise EngineFailure(f"{out}: self-check failed, {len(blocking)} engine load error(s), nothing published "
                            f"(the unpublished config is in {metadata_dir or out}); first: [{first.engine}] "
                            f"{first.message}")
    refused: dict[str, str] = {}
    for f in report.errors:
        for v in f.versions:
            refused.setdefault(f"{f.engine}=={v}", f"{f.message} (fix: {f.fix})")
    log(f"self-check: checked {', '.join(report.profiles)} (the releases quant verify-manifest checks by default)")
    for label, why in refused.items():
        log(f"note: {label} refuses this export (the newest releases load it; quant verify-manifest names it too): "
            f"{why}")
    return {"checked": list(report.profiles), "refused_by": refused}


def quantize_checkpoint(src: str | Path, out: str | Path, *, scheme: str = DEFAULT_SCHEME,
                        recipe: str | None = None, scale_mode: str = "even", devices: str | list[str] | None = None,
                        workers: int = 1, check_engines: list[str] | str | None = "auto",
                        progress: bool = False, method: str = "rtn", gptq: WeightSolver | None = None,
                        overwrite: bool = False, max_disk: int | None = None, stream: bool | None = None,
                        look_ahead: int = 1, log=print) -> dict:
    """Quantize checkpoint `src` into directory `out` (new, empty, or an earlier run's output to resume or
    redo); returns the manifest, with `timing` added. Every input is checked (headers and config only) before
    OUT is created.

    `method`: "rtn" (round to nearest) or "gptq", whose solver `gptq` (a `quant.pipeline.solver.WeightSolver`:
    quant.gptq.GptqSettings) the caller hands in. Either way the output has the same tensors, names, dtypes and
    shapes.

    `overwrite`: replace an earlier output of other settings, or write into a directory this tool did not make
    (`quant.ownership`; files it did not write are never deleted).

    A Hub id as `src` is streamed (`stream` None or True; rtn only): each source shard fetched into OUT's
    `.quant-source/` when needed, `look_ahead` shards ahead, deleted once written, never more than `max_disk`
    bytes of source on disk (`quant.pipeline.fetch`); the manifest then has `stream` added. `stream=False`
    downloads the whole repository first (huggingface_hub's cache)."""
    scheme = scheme_name(scheme)  # a peer's name for it (MXFP4, FP8_DYNAMIC, ptpc_fp8...): this tool's
    auto_engines = _is_auto(check_engines)
    check_engines = _check_arguments(scheme, method, gptq, scale_mode, check_engines, workers)
    hub = streamed_reference(src, stream)
    if hub is not None and method == "gptq":
        if stream:
            raise QuantError(f"--method gptq calibrates every layer from the whole source: it cannot stream "
                             f"{hub.label} (drop --stream: it is downloaded first, within --max-disk)")
        hub = None
    if look_ahead < 0:
        raise QuantError(f"--look-ahead {look_ahead}: must be 0 or more")
    src_path, source_ref, ckpt = _open_source(src, hub, max_disk, log)
    out = Path(out)
    Output(out, source=src_path, overwrite=overwrite).check()  # the root, the source, a foreign directory...
    device_list = parse_devices(devices, workers)

    require_valid(ckpt)
    family = family_for_config(ckpt.config, (src_path or ckpt.root) / "config.json")
    plan = make_plan(ckpt, family, load_recipe(recipe, family), get_scheme(scheme), scale_mode)
    if recipe and Path(recipe).is_file():
        plan.recipe_path = Path(recipe)
    if auto_engines:  # a mixed recipe (MXFP4 experts, MXFP8 elsewhere) is checked where every scheme it writes loads
        check_engines = scheme_releases({plan.scheme.name} | set(plan.quantized.values()))
    calibrated = None  # (the solver, what the family's decoder layer returns) when a solver computes the weights
    if method == "gptq":
        gptq.check(src_path, ckpt)  # e.g. a family GPTQ cannot build: refused before OUT is touched
        plan.settings.update(gptq.to_dict())  # part of the plan's digest: other settings, other output
        calibrated = (gptq, family.layer_returns)
    if hub is not None:
        check_disk(plan, ckpt, max_disk, len(device_list), look_ahead)
    require_loadable_drafts(ckpt)  # a draft file its engine's draft class cannot load: refused, never carried over
    scan_started = time.perf_counter()
    scanned = require_sound_scales(ckpt, log)  # what would stop the run halfway, refused before OUT holds a byte
    scan = {"scale_scan_s": round(time.perf_counter() - scan_started, 3), "scale_scan_bytes": scanned.bytes,
            "scale_scan_tensors": scanned.tensors}

    identity = {"source": source_ref, "scheme": scheme, "recipe": plan.recipe.get("name"), "scale_mode": scale_mode,
                "method": method, "plan_digest": plan.digest()}
    names = [s.file for s in plan.shards] + (side_files(src_path) if hub is None else side_file_names(ckpt)) \
        + sidecar_files_present(family.name, ckpt.config, ckpt.has_file)  # a draft file: refused if not ours too

    def files(todo: list[ShardJob], output: Output):
        if hub is None:
            return LocalFiles(ckpt, src_path, todo, len(device_list))
        return HubFiles(ckpt, output.root, todo, len(device_list), max_disk, look_ahead, log)

    def changed(output: Output, finished: dict):  # finished shards whose source files' bytes changed since
        if hub is not None:
            return HubChanges(ckpt, output.root, plan.shards).stale
        return LocalChanges(ckpt, plan.shards, finished, len(device_list)).stale

    with Output(out, identity, src_path, overwrite, names) as output:
        manifest = _quantize_into(output, plan, files, source_ref, device_list, check_engines, progress, log,
                                  calibrated, changed)
    manifest["timing"].update(scan)
    return manifest


def scheme_releases(schemes: set[str]) -> list[str]:
    """The default releases (each scheme's `engines`, engine rules default_releases) that load every scheme in
    `schemes`, in the engine files' order: the self-check's releases when none are named."""

    first, *rest = [[p.label for p in select_profiles(list(get_scheme(name).engines))] for name in sorted(schemes)]
    return [label for label in first if all(label in other for other in rest)]


def _is_auto(check_engines) -> bool:
    return check_engines == "auto" or (isinstance(check_engines, (list, tuple)) and list(check_engines) == ["auto"])


def _check_arguments(scheme: str, method: str, gptq, scale_mode: str, check_engines, workers: int):
    """Refuse a bad option before anything is read; returns the engine releases the self-check runs for."""

    get_scheme(scheme)  # an unknown scheme is refused first
    if method not in ("rtn", "gptq"):
        raise QuantError(f"unknown method {method!r}{did_you_mean(method, ('rtn', 'gptq'))}; choose rtn or gptq")
    if method == "gptq" and scheme not in MXFP4_SCHEMES:
        raise QuantError(f"--method gptq solves MXFP4 weights; scheme {scheme} has none (use w_mxfp4_a_mxfp4 "
                         f"or w_mxfp4)")
    if method == "gptq" and gptq is None:
        raise QuantError("--method gptq: no solver given (pass gptq=quant.gptq.GptqSettings(...))")
    if scale_mode not in SCALE_MODES:
        raise QuantError(f"unknown scale mode {scale_mode!r}{did_you_mean(scale_mode, SCALE_MODES)}; choose one of: "
                         f"{', '.join(SCALE_MODES)}")
    if _is_auto(check_engines):
        check_engines = scheme_releases({scheme})  # the default releases that load this scheme (schemes.py)
    if check_engines:
        select_profiles(list(check_engines))  # an unknown engine release is refused before any work
    if workers < 1:
        raise QuantError(f"--workers {workers}: must be at least 1")
    return check_engines


def _open_source(src, hub, max_disk: int | None, log):
    """(the local source directory or None, the reference the manifest records, the checkpoint to plan from): a
    streamed Hub source is read where it is (config, index and shard headers, quant.hub); one not streamed is
    downloaded into the HF cache first, every file checked against the Hub's sha256 (quant.pipeline.snapshot)."""
    if hub is None:
        if Path(src).is_dir():
            src_path, source_ref = Path(src), str(Path(src).resolve())
        else:
            ref = hub_reference(src)
            if ref is None:
                raise QuantError(f"{src}: not a checkpoint directory, nor a Hub repository ORG/NAME[@REVISION]")
            src_path, source_ref = cached_source(ref, max_disk, log)
        return src_path, source_ref, open_checkpoint(src_path)

    return None, source_reference(hub), open_hub_checkpoint(hub)


def _quantize_into(output: Output, plan: Plan, open_files, source_ref: str, device_list: list[str],
                   check_engines, progress: bool, log, calibrated=None, changed=None) -> dict:
    """The run itself, under the output lock: resume what is done, quantize the rest, stage, check, publish.
    `changed(output, finished)`: a predicate (shard, its finished result) for a shard to redo though finished
    (a source file it read has other bytes now), asked when an earlier run finished some shards."""
    out, digest = output.root, plan.digest()
    earlier_card = kept_card_parts(out)
    stale = output.begin()
    if stale:
        log(f"removed {len(stale)} temporary file(s) an interrupted run left: {', '.join(stale[:3])}")
    results: dict[str, ShardResult] = {}
    todo, redo = [], []
    finished = {s.file: completed(out, s, digest, hash_file=output.sha256) for s in plan.shards}
    finished = {f: r for f, r in finished.items() if r is not None}
    outdated = changed(output, finished)
    for shard in plan.shards:
        done = finished.get(shard.file)
        if done and outdated(shard, done):
            redo.append(shard.file)
            done = None
        if done:
            results[shard.file] = done
        else:
            todo.append(shard)
    if redo:
        log(f"the source changed since the earlier run: {len(redo)} finished shard(s) read source files whose "
            f"bytes differ now and are made again ({', '.join(redo[:3])})")
    if results:
        log(f"resuming: {len(results)} of {len(plan.shards)} shards already complete and verified")

    started = time.perf_counter()
    timing = Counter()
    with open_files(todo, output) as files:
        solved = _solve(calibrated, todo, plan, files, out, device_list, log, digest, timing, started)
        _run_shards(plan, digest, todo, files.ckpt, out, device_list, files, timing, results, progress, solved)
        elapsed = time.perf_counter() - started
        ordered = [results[s.file] for s in plan.shards]
        manifest = stage_outputs(output, plan, files.ckpt.config, files.root, ordered, source_ref, device_list,
                                 earlier_card, list(check_engines or []), plan.recipe_path)
    scale_check(out, output.staging_dir)
    if check_engines:
        manifest["engines"].update(self_check(out, list(check_engines), output.staging_dir, log))
        config = json.loads((output.staging_dir / "config.json").read_text())
        stage_record(output, manifest, config, files.root, source_ref, earlier_card)
    card = without_accuracy((output.staging_dir / CARD_FILE).read_text()).encode()
    output.own([r.file for r in ordered], hashes={r.file: (r.bytes, r.sha256) for r in ordered})
    output.publish(json.dumps({"plan_digest": digest, "version": __version__, "card_sha256": sha256_bytes(card)}))
    shutil.rmtree(out / GPTQ_DIR, ignore_errors=True)  # every shard holds its solved weights now
    manifest["timing"] = {"total_s": time.perf_counter() - started, "shards_s": elapsed,
                          **{k: round(v, 3) for k, v in timing.items()}}
    if files.summary() is not None:
        manifest["stream"] = {**files.summary(), "shards_s": round(elapsed, 3)}
    return manifest


def _solve(calibrated, todo, plan: Plan, files, out: Path, device_list, log, digest: str, timing: Counter,
           started: float):
    """The solver's weights (GPTQ's), or None for round to nearest."""
    if not (calibrated and todo):
        return None
    solver, layer_returns = calibrated
    request = SolveRequest(plan, files.ckpt, files.root, out / GPTQ_DIR, device_list, layer_returns, digest, log,
                           write_atomic)
    # The solver runs at one worker's thread count on the first device (GPTQ: calibration and Hessians there,
    # the same bytes whatever the device list; each layer's solves shared among every device).
    with _compute_runtime(device_list[:1]):
        solved = solver.solve(request)
    timing[f"{solver.method}_s"] = time.perf_counter() - started
    timing.update(solved.timing)  # its phases (GPTQ: quant.gptq.run.PHASES)
    return solved


def run_shard(*args, **kwargs):
    """`execute.run_shard` (a ShardResult, or with defer_write the write to run), imported on first use because
    it loads torch."""

    return execute.run_shard(*args, **kwargs)


@contextlib.contextmanager
def _compute_runtime(device_list: list[str]):
    """Load torch for the run (its import overlaps the source hashing; `process.frozen_imports`), and give CPU
    workers their share of the cores (`process.cpu_threads`); the caller's thread count comes back after."""

    def imports():
        import torch  # noqa: F401

        from quant.pipeline import execute  # noqa: F401  (the rest of the heavy imports: numerics, safetensors)

    with frozen_imports(imports):
        import torch

        before = threads = torch.get_num_threads()
        if all(torch.device(d).type == "cpu" for d in device_list):
            threads = cpu_threads(len(device_list))
        try:
            yield threads
        finally:
            torch.set_num_threads(before)


def _run_shards(plan: Plan, digest: str, todo: list, ckpt, out: Path, device_list: list[str], files,
                timing: Counter, results: dict[str, ShardResult], progress: bool, solved=None) -> None:
    """Quantize the shards in `todo`, one in flight per worker, so a failure stops the run before later shards
    start. Finished results go into `results`.

    A single worker hands each quantized shard to this thread, which writes it while the worker goes on with the
    next one (a pool of writer threads measured slower on two cores: one more thread competing for them).
    Several workers write their own shards, so writing keeps pace with the devices."""
    write_here = len(device_list) == 1
    with _progress(progress, plan, todo, files.status) as advance, _compute_runtime(device_list) as threads:
        def work(i_shard):
            i, shard = i_shard
            set_threads(threads)  # OpenMP keeps a thread count per thread: the compiled kernels read this one
            files.ready(shard)  # a streamed source: its files fetched and verified (quant.pipeline.fetch)
            return shard, run_shard(plan, digest, shard, ckpt, out, device_list[i % len(device_list)],
                                    files.source_hash(shard), timing, defer_write=write_here, solved=solved)

        queue = iter(enumerate(todo))
        with ThreadPoolExecutor(max_workers=len(device_list)) as pool:
            running = {pool.submit(work, item) for item in itertools.islice(queue, len(device_list))}
            while running:
                finished, running = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    shard, done = future.result()
                    running |= {pool.submit(work, item) for item in itertools.islice(queue, 1)}
                    result = done() if write_here else done
                    results[result.file] = result
                    files.finished(shard)  # a streamed source: what no later shard reads is deleted
                    advance(shard.source_bytes)


class _progress:
    """A rich progress bar over source bytes (GB/s and ETA), or nothing; a streamed source adds its download
    rate and the disk its files hold (`status`)."""

    def __init__(self, enabled: bool, plan: Plan, todo, status=None):
        self.enabled, self.plan, self.todo, self.status = enabled, plan, todo, status

    def __enter__(self):
        if not self.enabled:
            return lambda n: None
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

        columns = [TextColumn("[bold]quantize"), BarColumn(), TextColumn("{task.fields[shards]} shards"),
                   TransferSpeedColumn(), TimeRemainingColumn()]
        if self.status is not None:
            columns.append(_StatusColumn(self.status))
        self.bar = Progress(*columns)
        self.bar.__enter__()
        self.done = 0
        self.task = self.bar.add_task("quantize", total=sum(s.source_bytes for s in self.todo) or 1,
                                      shards=f"0/{len(self.todo)}")

        def advance(nbytes: int):
            self.done += 1
            self.bar.update(self.task, advance=nbytes, shards=f"{self.done}/{len(self.todo)}")

        return advance

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.__exit__(*exc)
        return False


def _StatusColumn(status):
    """A progress column showing `status()` (the fetcher's download rate and disk in use) at every refresh."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class StatusColumn(ProgressColumn):
        def render(self, task):
            return Text(status())

    return StatusColumn()
