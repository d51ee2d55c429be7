"""The two arms of a comparison built and run: the data and the offline task files, the baseline (run, or reused
from an earlier eval's output) and then the candidate, each with its MTP acceptance (evals.replay), its answers
kept (evals/arms/answers.py) and its per-question samples under the scratch directory's runs/."""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path

from evals.arms import hub_data
from evals.arms.answers import open_store, read_identity, write_identity
from evals.arms.backends import Backend, BackendOptions, open_backend
from evals.arms.lm_eval_run import SAMPLES_FILE, RunSettings, go_offline, run_arm, run_dir_name, write_records
from evals.arms.tasks import write_task_files
from evals.out_dir import RUNS_DIR
from evals.replay import measure_mtp, server_mtp
from evals.report.render import REPORT_JSON
from evals.request import EvalRequest
from evals.statistics import evidence
from evals.tasks.data_sources import sources_of
from quant.errors import QuantError

RUN_SETTINGS = ("limit", "seeds", "max_gen_toks", "temperature", "top_p", "mtp_depth", "thinking")


def load_baseline_run(run: Path, specs, settings: dict) -> tuple[dict, list[dict], dict | None]:
    """The baseline arm of an earlier `quant eval` output (its report.json, per-question samples and the identity of
    the model that answered, None for an output written before identities were), checked to have run the same
    tasks with the same generation settings; prompts are checked again when pairing."""
    report_path = Path(run) / REPORT_JSON
    try:
        earlier = json.loads(report_path.read_text())
    except (OSError, ValueError) as e:
        raise QuantError(f"--baseline-run {run}: no finished eval output here ({report_path}: {e})") from None
    for key in RUN_SETTINGS:
        if earlier["settings"].get(key) != settings[key]:
            raise QuantError(f"--baseline-run {run}: it ran with {key}={earlier['settings'].get(key)!r}, this run "
                             f"uses {settings[key]!r}; the baseline must be generated with the same settings")
    records = []
    for spec in specs:
        for seed in RunSettings(limit=None, max_gen_toks=None, seeds=settings["seeds"]).seed_list(spec):
            path = Path(run) / "runs" / "baseline" / run_dir_name(spec, seed) / SAMPLES_FILE
            if not path.is_file():
                raise QuantError(f"--baseline-run {run}: no baseline samples for {spec.name} ({path})")
            records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return earlier["baseline"], records, read_identity(Path(run) / RUNS_DIR / "baseline")


def run_arms(request: EvalRequest, specs, earlier, scratch: Path, log) -> tuple[dict, list[dict], dict, list[dict]]:
    """Both arms (the baseline first, or `earlier`'s reused; an arm with failed requests stops the run before the
    next), their samples left in scratch/runs/; returns each arm's description and records."""
    datasets_cache = scratch / "hf_datasets_cache"
    task_dir = write_task_files(scratch / "tasks", specs, data=eval_data(request, specs, scratch / "data"),
                                datasets_cache=datasets_cache, thinking=request.thinking)
    go_offline(datasets_cache)
    run_settings = RunSettings(limit=request.limit, max_gen_toks=request.max_gen_toks, seeds=request.seeds,
                               temperature=request.temperature, top_p=request.top_p, thinking=request.thinking)
    options = BackendOptions(endpoint=request.endpoint, server_model=request.server_model,
                             concurrency=request.concurrency, max_retries=request.max_retries,
                             timeout=request.timeout, max_gen_toks=request.max_gen_toks or 512,
                             batch_size=request.batch_size, device=request.device, dtype=request.dtype,
                             mtp=request.mtp, activations=request.activations)
    if earlier:
        baseline_arm, baseline = _reuse_baseline(request, specs, earlier, scratch, log)
    else:
        baseline_arm, baseline = _run("baseline", request.baseline, request.baseline_name, specs, task_dir, scratch,
                                      run_settings, options, request.mtp_depth, log)
    evidence.check_failures("baseline", baseline_arm, _generations(baseline))  # before the candidate arm runs
    candidate_arm, candidate = _run("candidate", request.candidate, request.candidate_name, specs, task_dir, scratch,
                                    run_settings, options, request.mtp_depth, log)
    evidence.check_failures("candidate", candidate_arm, _generations(candidate))
    for name in ("work", "hf_datasets_cache"):
        shutil.rmtree(scratch / name, ignore_errors=True)
    return baseline_arm, baseline, candidate_arm, candidate


def _reuse_baseline(request: EvalRequest, specs, earlier, scratch: Path, log) -> tuple[dict, list[dict]]:
    baseline_arm, baseline, identity = earlier
    baseline_arm = {**baseline_arm, "reused_from": str(request.baseline_run)}
    write_records(scratch / RUNS_DIR / "baseline", specs, baseline)
    if identity is not None:  # passed on: a run reusing these answers again knows whose they are
        write_identity(scratch / RUNS_DIR / "baseline", identity)
    log(f"baseline: reusing the samples of {request.baseline_run}")
    return baseline_arm, baseline


def eval_data(request: EvalRequest, specs, dest: Path) -> dict[str, Path | None]:
    """{data source: local path} of the tasks' data: the user's copy, else the hub's (fetched under `dest` before
    the run goes offline), else None (a local-only source with no copy: the task writer names the flag)."""

    data = {}
    for source in sources_of(specs):
        local = source.local_copy(request)
        data[source.name] = local if local is not None or source.hub is None else hub_data.fetch(source, dest)
    return data


def _generations(records: list[dict]) -> int:
    """Generations an arm asked for: one per (task, seed, question), whatever the filters."""
    return len({(r["task"], r["seed"], r["doc_id"]) for r in records})


def _run(label: str, source: str, name: str | None, specs, task_dir: Path, scratch: Path, settings: RunSettings,
         options: BackendOptions, depth: int, log) -> tuple[dict, list[dict]]:
    log(f"{label}: loading {source}")
    backend = open_backend(source, label, options, scratch / "work")
    log(f"{label}: {backend.description}")
    server_spec = None
    if backend.kind == "server" and options.mtp:
        from evals.arms.server_metrics import probe

        server_spec = probe(source)  # vLLM: the counters before this arm's requests
    store = open_store(scratch, backend, options)
    write_identity(scratch / RUNS_DIR / label, store.identity)  # whose answers these are (for --baseline-run)
    try:
        records = run_arm(backend, specs, task_dir, scratch / RUNS_DIR / label, settings, log=log, store=store)
        if store.kept:
            log(f"{label}: {store.kept} answers kept from an earlier run, {store.asked} asked")
        if backend.kind == "server":
            mtp = server_mtp(server_spec, records, specs, settings, options, log, store) if server_spec else \
                {"measured": False, "why": "MTP not measured (--mtp off)"}
        else:
            mtp = measure_mtp(backend, records, depth, log)
    finally:
        store.close()
    arm = {"source": source, "name": name or _weights_name(backend), "kind": backend.kind,
           "description": backend.description, "notes": backend.notes, "failed_requests": backend.failures(),
           "first_error": backend.first_error(), "activations": backend.activations,
           "mtp": mtp}
    if any("mtp" in r for r in records):  # run_arm wrote the samples before the acceptance was attached
        write_records(scratch / RUNS_DIR / label, specs, records)
    _release(backend)
    return arm, records


def _weights_name(backend: Backend) -> str:
    if backend.kind == "server":
        return backend.label
    for fmt in ("MXFP4", "FP8 block", "FP8"):
        if fmt + " " in backend.description:
            return fmt.replace(" block", "")
    return "BF16"


def _release(backend: Backend) -> None:
    backend.lm = None
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass
