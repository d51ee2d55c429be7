"""`quantize_checkpoint`: read → plan → quantize → write → verify, streaming one shard at a time.

Output layout: quantized shards, model.safetensors.index.json, config.json with the quantization_config,
tokenizer/generation files, quant_manifest.json (per-tensor audit), README.md (model card) and
`.quant-complete`. The final files are staged and published only after every shard is written and the
self-check passed, config.json last, so an interrupted or failed output never looks like a finished checkpoint.
"""

from __future__ import annotations

import contextlib
import fnmatch
import gc
import itertools
import json
import os
import re
import shutil
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

from quant import __version__
from quant.checkpoint import INDEX_FILE, open_checkpoint
from quant.errors import QuantError
from quant.pipeline.files import OutputLock, sha256_file, write_atomic
from quant.pipeline.model_card import CARD_FILE, render_card
from quant.pipeline.progress import PROGRESS_DIR, ShardResult, completed
from quant.pipeline.plan import Plan, make_plan
from quant.pipeline.quark_config import official_fp8_config, quark_quantization_config
from quant.pipeline.recipes import family_for_config, load_recipe
from quant.numerics import SCALE_MODES
from quant.pipeline.schemes import get_scheme
from quant.pipeline.source import resolve_source

COMPLETE_MARKER = ".quant-complete"
# config.json, index, manifest and card are written here first and moved beside the shards only after the
# self-check passed, so an OUT that was interrupted or failed its check never holds a config.json.
STAGING_DIR = ".quant-staging"
STALE_TMP = re.compile(r"^\.tmp[A-Za-z0-9_]{6,8}$")
MANIFEST_FILE = "quant_manifest.json"
OWN_FILES = {"config.json", INDEX_FILE, MANIFEST_FILE, COMPLETE_MARKER, CARD_FILE}
LAYER_PREFIX = re.compile(r"^.*?layers\.\d+\.")


def check_paths(src: Path, out: Path) -> None:
    s, o = src.resolve(), out.resolve()
    if o == s or s in o.parents:
        raise QuantError(f"{out}: the output must not be the source checkpoint or inside it ({src})")
    if o in s.parents:
        raise QuantError(f"{out}: the output must not contain the source checkpoint ({src})")
    if o.exists() and not o.is_dir():
        raise QuantError(f"{out}: exists and is not a directory")
    if o.is_dir() and any(o.iterdir()) and not is_earlier_output(o):
        raise QuantError(f"{out}: directory is not empty and is not an earlier quant output; "
                         f"choose an empty or new directory")


def is_earlier_output(out: Path) -> bool:
    """An earlier (or running) quantize's output: finished (marker), with shard progress records of ours, or
    holding nothing but our own bookkeeping. A foreign directory with an empty `.quant-progress/` is not."""
    if (out / COMPLETE_MARKER).exists():
        return True
    progress = out / PROGRESS_DIR
    for record in progress.glob("*.json") if progress.is_dir() else ():
        try:
            if "plan_digest" in json.loads(record.read_text()):
                return True
        except (OSError, ValueError):
            continue
    return all(p.name in (PROGRESS_DIR, STAGING_DIR, OutputLock.NAME) for p in out.iterdir())


def remove_stale_temporaries(out: Path) -> list[str]:
    """Temporary files an interrupted run of ours left in `out` (our `<shard>.tmp`, the `.tmpXXXXXX` files a
    killed safetensors write leaves); called under the output lock, so no live run owns them."""
    stale = [p for p in out.iterdir() if p.is_file() and (p.name.endswith(".tmp") or STALE_TMP.match(p.name))]
    for p in stale:
        p.unlink(missing_ok=True)
    return [p.name for p in stale]


def visible_accelerators() -> int:
    """CUDA/ROCm devices torch can use. torch is imported only when the machine has an NVIDIA or AMD GPU device
    node: its import costs a second that the CPU path spends hashing instead."""
    dev = Path("/dev")
    if not (any(dev.glob("nvidia[0-9]*")) or (dev / "kfd").exists()):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def auto_devices(workers: int, accelerators: int) -> list[str]:
    """`--devices auto`: one worker per visible GPU, else `workers` CPU workers."""
    return [f"cuda:{i}" for i in range(accelerators)] if accelerators else ["cpu"] * max(1, workers)


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


def secondary_patterns(plan: Plan) -> dict[str, str]:
    """Glob patterns for modules whose scheme differs from the primary one (layer_quant_config keys).
    A pattern drops the layer prefix ("*self_attn.o_proj") so it also matches SGLang's MTP runtime names."""
    patterns = {}
    for module, scheme in plan.quantized.items():
        if scheme != plan.scheme.name:
            patterns["*" + LAYER_PREFIX.sub("", module)] = scheme
    for module, scheme in plan.quantized.items():
        if scheme == plan.scheme.name:
            hit = next((p for p in patterns if fnmatch.fnmatchcase(module, p)), None)
            if hit:
                raise QuantError(f"recipe {plan.recipe['name']!r}: {module} is {scheme} but pattern {hit} "
                                 f"puts modules of the same name in other layers in {patterns[hit]}")
    return patterns


def render_exclude(plan: Plan, config: dict) -> list[str]:
    from quant.engines import exclude_aliases

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
                                     secondary_patterns(plan))


def copy_side_files(src: Path, out: Path) -> list[str]:
    """Tokenizer, generation config, chat template...: every top-level file that is not weights or ours."""
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and f.name not in OWN_FILES and not f.name.startswith("."):
            shutil.copy2(f, out / f.name)
            copied.append(f.name)
    return copied


def write_outputs(plan: Plan, src_config: dict, src: Path, out: Path, results: list[ShardResult],
                  source_ref: str, devices: list[str] | None = None) -> dict:
    """Copy the side files into `out` and stage the final files in `out/STAGING_DIR` (see `publish`)."""
    staging = out / STAGING_DIR
    staging.mkdir(exist_ok=True)
    weight_map = {name: r.file for r in results for name in r.tensors}
    total = sum(r.bytes for r in results)
    write_atomic(staging / INDEX_FILE, json.dumps({"metadata": {"total_size": total},
                                               "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    side = copy_side_files(src, out)
    config = {k: v for k, v in src_config.items() if k != "quantization_config"}
    config["quantization_config"] = quantization_config(plan, src_config)
    manifest = {
        "tool": "moe-quant", "version": __version__, "settings": plan.settings, "recipe": plan.recipe,
        "source": {"checkpoint": source_ref, "format": plan.source_format,
                   "shards": {r.source_file: {"sha256": r.source_sha256} for r in results}},
        "output": {"shards": {r.file: {"sha256": r.sha256, "bytes": r.bytes} for r in results},
                   "copied_files": side},
        "mtp_layers": plan.mtp_layers,
        "run": {"devices": list(devices or [])},
        "kept_bf16": plan.kept_modules,
        "exclude": config["quantization_config"].get("exclude",
                                                     config["quantization_config"].get("modules_to_not_convert")),
        "summary": summarize(results),
        "tensors": {name: rec for r in results for name, rec in r.records.items()},
    }
    write_atomic(staging / MANIFEST_FILE, json.dumps(manifest, indent=1, sort_keys=True))
    source_card = src / CARD_FILE
    card = render_card(manifest, config, source_ref,
                       source_card.read_text(errors="replace") if source_card.is_file() else None)
    write_atomic(staging / CARD_FILE, card)
    write_atomic(staging / "config.json", json.dumps(config, indent=2))
    return manifest


def publish(out: Path, marker: str) -> None:
    """Move the staged final files beside the shards with config.json last; the completion marker goes just
    before it, so at every instant OUT either lacks config.json (visibly unfinished) or is complete."""
    staging = out / STAGING_DIR
    for name in (INDEX_FILE, MANIFEST_FILE, CARD_FILE):
        os.replace(staging / name, out / name)
    write_atomic(out / COMPLETE_MARKER, marker)
    os.replace(staging / "config.json", out / "config.json")
    staging.rmdir()


def summarize(results: list[ShardResult]) -> dict:
    counts: dict[str, int] = {}
    worst = None
    for r in results:
        for name, rec in r.records.items():
            key = rec.get("scheme") or rec["action"]
            counts[key] = counts.get(key, 0) + 1
            if "rel_mse" in rec and (worst is None or rec["rel_mse"] > worst[1]):
                worst = (name, rec["rel_mse"])
    return {"modules_by_treatment": counts, "worst_rel_mse": {"module": worst[0], "rel_mse": worst[1]} if worst
            else None, "output_bytes": sum(r.bytes for r in results)}


def self_check(out: Path, engines: list[str], metadata_dir: Path | None = None) -> None:
    from quant.verify import verify_checkpoint

    report = verify_checkpoint(out, engines=engines, metadata_dir=metadata_dir)
    if report.errors:
        first = report.errors[0]
        raise QuantError(f"{out}: self-check failed, {len(report.errors)} engine load error(s), nothing published "
                         f"(the unpublished config is in {metadata_dir or out}); first: [{first.engine}] "
                         f"{first.message}")


def quantize_checkpoint(src: str | Path, out: str | Path, *, scheme: str = "w_mxfp4_a_mxfp4",
                        recipe: str | None = None, scale_mode: str = "even", devices: str | list[str] | None = None,
                        workers: int = 1, check_engines: list[str] | None = ("sglang==latest", "vllm==latest"),
                        progress: bool = False, log=print) -> dict:
    scheme_obj = get_scheme(scheme)
    if scale_mode not in SCALE_MODES:
        raise QuantError(f"unknown scale mode {scale_mode!r}; choose one of: {', '.join(SCALE_MODES)}")
    src_path, source_ref = resolve_source(src)
    out = Path(out)
    check_paths(src_path, out)
    device_list = parse_devices(devices, workers)

    ckpt = open_checkpoint(src_path)
    family = family_for_config(ckpt.config, src_path / "config.json")
    plan = make_plan(ckpt, family, load_recipe(recipe), scheme_obj, scale_mode)
    digest = plan.digest()

    out.mkdir(parents=True, exist_ok=True)
    with OutputLock(out):
        return _quantize_into(out, plan, digest, ckpt, src_path, source_ref, device_list, check_engines, progress,
                              log)


def _quantize_into(out: Path, plan: Plan, digest: str, ckpt, src_path: Path, source_ref: str,
                   device_list: list[str], check_engines, progress: bool, log) -> dict:
    """The run itself, under the output lock: resume what is done, quantize the rest, stage, check, publish."""
    stale = remove_stale_temporaries(out)
    if stale:
        log(f"removed {len(stale)} temporary file(s) an interrupted run left: {', '.join(stale[:3])}")
    results: dict[str, ShardResult] = {}
    todo = []
    for shard in plan.shards:
        done = completed(out, shard, digest)
        if done:
            results[shard.file] = done
        else:
            todo.append(shard)
    if results:
        log(f"resuming: {len(results)} of {len(plan.shards)} shards already complete and verified")

    started = time.perf_counter()
    timing = Counter()
    # Source hashes run on threads of their own (one per worker, so hashing keeps up with several devices), in
    # shard order, from before torch loads to beside the quantizing workers.
    with ThreadPoolExecutor(max_workers=len(device_list)) as hasher:
        hashes = {shard.file: hasher.submit(sha256_file, ckpt.shard_path(shard.source_file)) for shard in todo}
        try:
            # A re-run starts visibly incomplete: an earlier run's final files go until this one publishes.
            for name in (COMPLETE_MARKER, "config.json", INDEX_FILE, MANIFEST_FILE, CARD_FILE):
                (out / name).unlink(missing_ok=True)
            (out / PROGRESS_DIR).mkdir(exist_ok=True)
            _run_shards(plan, digest, todo, ckpt, out, device_list, hashes, timing, results, progress)
        finally:
            for future in hashes.values():
                future.cancel()  # after a failure, shards never started need no hash
    elapsed = time.perf_counter() - started

    ordered = [results[s.file] for s in plan.shards]
    manifest = write_outputs(plan, ckpt.config, src_path, out, ordered, source_ref, device_list)
    if check_engines:
        self_check(out, list(check_engines), out / STAGING_DIR)
    publish(out, json.dumps({"plan_digest": digest, "version": __version__}))
    manifest["timing"] = {"total_s": time.perf_counter() - started, "shards_s": elapsed,
                          **{k: round(v, 3) for k, v in timing.items()}}
    return manifest


def run_shard(*args, **kwargs):
    """`execute.run_shard` (a ShardResult, or with defer_write the write to run), imported on first use because
    it loads torch."""
    from quant.pipeline import execute

    return execute.run_shard(*args, **kwargs)


@contextlib.contextmanager
def _compute_runtime(device_list: list[str]):
    """Load torch for the run, and set the intra-op threads of CPU workers: the cores left after one for hashing
    and writing, shared by the workers. On two cores that is one thread: a second one would wait a scheduler
    timeslice at the end of each kernel whenever the hasher holds its core (seconds per run, and irregular)."""
    # The run's first import of torch (it overlaps the source hashing) creates a few hundred thousand objects and
    # no garbage; the collector would walk them over and over, during the import and the whole run (8% of the CPU
    # time on two cores). So no collection while importing, and the objects stay frozen until the run ends.
    collecting, freezing = gc.isenabled(), gc.get_freeze_count() == 0  # never thaw what the caller froze
    gc.disable()
    try:
        import torch

        from quant.pipeline import execute  # noqa: F401  (the rest of the heavy imports: numerics, safetensors)
    finally:
        if freezing:
            gc.freeze()
        if collecting:
            gc.enable()
    before = torch.get_num_threads()
    threads = before
    if all(torch.device(d).type == "cpu" for d in device_list):
        threads = max(1, ((os.cpu_count() or 1) - 1) // len(device_list))
    try:
        yield threads
    finally:
        if freezing:
            gc.unfreeze()
        torch.set_num_threads(before)


def _set_threads(n: int) -> None:
    import torch

    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def _run_shards(plan: Plan, digest: str, todo: list, ckpt, out: Path, device_list: list[str], hashes: dict,
                timing: Counter, results: dict[str, ShardResult], progress: bool) -> None:
    """Quantize the shards in `todo`, one in flight per worker, so a failure stops the run before later shards
    start. Finished results go into `results`.

    A single worker hands each quantized shard to this thread, which writes it while the worker goes on with the
    next one (a pool of writer threads measured slower on two cores: one more thread competing for them).
    Several workers write their own shards, so writing keeps pace with the devices."""
    write_here = len(device_list) == 1
    with _progress(progress, plan, todo) as advance, _compute_runtime(device_list) as threads:
        def work(i_shard):
            i, shard = i_shard
            _set_threads(threads)  # OpenMP keeps a thread count per thread: the compiled kernels read this one
            return shard, run_shard(plan, digest, shard, ckpt, out, device_list[i % len(device_list)],
                                    hashes[shard.file], timing, defer_write=write_here)

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
                    advance(shard.source_bytes)


class _progress:
    """A rich progress bar over source bytes (GB/s and ETA), or nothing."""

    def __init__(self, enabled: bool, plan: Plan, todo):
        self.enabled, self.plan, self.todo = enabled, plan, todo

    def __enter__(self):
        if not self.enabled:
            return lambda n: None
        from rich.progress import (BarColumn, Progress, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)

        self.bar = Progress(TextColumn("[bold]quantize"), BarColumn(), TextColumn("{task.fields[shards]} shards"),
                            TransferSpeedColumn(), TimeRemainingColumn())
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
