"""The eval stage end to end: validate inputs, write the offline task files, run both arms, pair the answers,
compute the statistics and write the report. Data flows one way; report.json is written last."""

from __future__ import annotations

import gc
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from evals.statistics import evidence

from evals.statistics import accuracy
from evals.arms.answers import ANSWERS_DIR, digests_for_this_run, open_store, read_identity, write_identity
from evals.arms.backends import ACTIVATIONS, DTYPES, Backend, BackendOptions, is_url, open_backend
from evals.statistics.acceptance import compare_acceptance
from evals.statistics.pairing import generation_counts, pair_acceptance, pair_scores
from evals.statistics.recovery import recovery
from evals.gate import apply_gate, check_run, gate_from_baseline, read_gate, write_gate
from evals.report.render import METHODS, REPORT_JSON, write_report
from evals.statistics.results import ComparisonRow, EvalReport
from evals.statistics.verdict import Verdict
from evals.arms.lm_eval_run import SAMPLES_FILE, RunSettings, go_offline, run_arm, run_dir_name, write_records
from evals.arms.tasks import EVAL_DATA_DIR, THINKING_MODES, parse_tasks, write_task_files
from quant.errors import QuantError, machine_failure, naming
from quant.ownership import remove_path

EXIT_CODES = {Verdict.PASS: 0, Verdict.FAIL: 1, Verdict.INCONCLUSIVE: 3, Verdict.INVALID: 4}
# What an eval leaves in OUT: the per-question samples of each arm, and the report (report.json last).
RUNS_DIR = "runs"
OWN_FILES = (REPORT_JSON, "report.md", "report.png")
# Everything else (the task files, the data, lm-eval's datasets cache, the backends' work space, and the runs
# while they are under way) lives in a scratch directory of ours (quant.ownership.SCRATCH).
SCRATCH_DIR = ".quant-eval"
MAX_MARGIN_POINTS = 50.0  # a margin wider than this admits any candidate: refused as a mistake
GSM8K_TASKS = {"gsm8k", "gsm8k_boxed"}  # the tasks asked on GSM8K's data (--data-dir, else the hub)


@dataclass(frozen=True)
class EvalRequest:
    candidate: str
    baseline: str | None = None         # checkpoint or URL; or reuse an earlier run's baseline (baseline_run)
    baseline_run: Path | None = None
    tasks: str = "gsm8k,gpqa_diamond"
    out: Path = Path("eval-out")
    limit: int | None = 200
    seeds: int = 2
    margin: float = 2.0
    data_dir: Path | None = None
    gpqa_csv: Path | None = None
    max_gen_toks: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    endpoint: str = "completions"
    server_model: str | None = None
    concurrency: int = 8
    max_retries: int = 3
    timeout: int = 3600
    batch_size: int = 16
    device: str | None = None
    dtype: str = "bfloat16"
    baseline_name: str | None = None
    candidate_name: str | None = None
    mtp: bool = True                    # measure MTP draft acceptance where an arm has a draft
    mtp_depth: int = 3                  # draft tokens per verification round (speculative_num_steps)
    mtp_margin: float = 5.0             # non-inferiority margin on depth-1 acceptance, in points
    toy_data_dir: Path = EVAL_DATA_DIR / "toy_arith"
    overwrite: bool = False             # write into an --out this tool did not make (quant.ownership)
    gate: Path | None = None            # a CI gate file (vLLM's GSM8K config format: evals/gate.py)
    write_gate: Path | None = None      # write a gate file from this run's baseline arm
    resume: bool = True                 # reuse the answers an interrupted run into the same --out kept
    activations: str | None = None      # in process: "emulate" | "bf16"; None: emulate where the scheme quantizes
    thinking: str | None = None         # "on" | "off": the chat template's thinking switch; None: its default


def _check(request: EvalRequest) -> None:
    import math

    if not math.isfinite(request.margin) or not 0 < request.margin <= MAX_MARGIN_POINTS:
        raise QuantError(f"--margin {request.margin:g}: must be a number of points in (0, {MAX_MARGIN_POINTS:g}] "
                         f"(a wider margin admits any candidate)")
    for flag, value in (("--concurrency", request.concurrency), ("--timeout", request.timeout),
                        ("--batch-size", request.batch_size), ("--max-retries", request.max_retries)):
        if value < 1:
            raise QuantError(f"{flag} {value}: must be at least 1")
    if request.dtype not in DTYPES:
        raise QuantError(f"--dtype {request.dtype!r}: choose from {', '.join(DTYPES)}")
    if request.activations is not None and request.activations not in ACTIVATIONS:
        raise QuantError(f"--activations {request.activations!r}: choose from {', '.join(ACTIVATIONS)}")
    if request.thinking is not None and request.thinking not in THINKING_MODES:
        raise QuantError(f"--thinking {request.thinking!r}: choose from {', '.join(THINKING_MODES)}")
    if request.max_gen_toks is not None and request.max_gen_toks < 1:
        raise QuantError(f"--max-gen-toks {request.max_gen_toks}: must be a positive number of tokens")
    for flag, value in (("--temperature", request.temperature), ("--top-p", request.top_p)):
        if not math.isfinite(value) or value < 0 or (flag == "--top-p" and not 0 < value <= 1):
            raise QuantError(f"{flag} {value:g}: out of range")
    if request.device is not None:
        _check_device(request.device)
    if not math.isfinite(request.mtp_margin) or not 0 < request.mtp_margin <= 100:
        raise QuantError(f"--mtp-margin {request.mtp_margin:g}: must be a number of points in (0, 100]")
    if not 1 <= request.mtp_depth <= 16:
        raise QuantError(f"--mtp-depth {request.mtp_depth}: must be 1 to 16 draft tokens")
    if request.seeds < 1:
        raise QuantError(f"--seeds {request.seeds}: must be at least 1")
    if request.limit is not None and request.limit < 1:
        raise QuantError(f"--limit {request.limit}: must be positive (0 means all questions)")
    if (request.baseline is None) == (request.baseline_run is None):
        raise QuantError("give exactly one of --baseline (checkpoint or URL) and --baseline-run (earlier output)")
    sources = [("candidate", request.candidate)] + ([("baseline", request.baseline)] if request.baseline else [])
    if request.baseline and _same_source(request.candidate, request.baseline):
        raise QuantError(f"--candidate and --baseline are the same model ({request.candidate}); a comparison of a "
                         f"model with itself proves nothing")
    for label, source in sources:
        if is_url(source):
            continue
        if not Path(source).is_dir():
            raise QuantError(f"--{label} {source}: not a checkpoint directory or an http(s):// server URL")
        # Headers and config only (seconds on any size): a broken candidate is found before the baseline runs.
        from quant.checkpoint import open_checkpoint

        ckpt = open_checkpoint(source)
        ckpt.require_intact()
        if request.activations != "bf16" and "quantization_config" in ckpt.config:
            from quant.dequant import activation_formats

            activation_formats(ckpt)  # an activation scheme --activations emulate cannot model: refused here
    for flag, path in (("--data-dir", request.data_dir), ("--gpqa-csv", request.gpqa_csv),
                       ("--baseline-run", request.baseline_run)):
        if path is not None and not Path(path).exists():
            raise QuantError(f"{flag} {path}: not found")


def _same_source(a: str, b: str) -> bool:
    if is_url(a) or is_url(b):
        from evals.arms.backends import api_root

        return is_url(a) and is_url(b) and api_root(a) == api_root(b)
    return Path(a).resolve() == Path(b).resolve()


def _check_chat(request: EvalRequest, specs) -> None:
    """Chat tasks need a server's chat endpoint; --thinking needs every task asked through a chat template."""
    servers = [s for s in (request.candidate, request.baseline) if s and is_url(s)]
    for spec in specs:
        if spec.chat and servers and request.endpoint != "chat":
            raise QuantError(f"--tasks {spec.name} is a chat task: servers are asked it with --endpoint chat")
        in_process = [s for s in (request.candidate, request.baseline) if s and not is_url(s)]
        if request.thinking is not None and not spec.chat and (in_process or request.endpoint != "chat"):
            raise QuantError(f"--thinking {request.thinking}: {spec.name} is asked as a plain completion, with no chat "
                             f"template to switch thinking in (chat tasks: gsm8k_boxed; or servers with "
                             f"--endpoint chat)")


def _check_inputs(request: EvalRequest, specs) -> None:
    """What can be checked before any work beyond the arguments: the data files, the data the hub must give
    (all of it named in one error when the hub is off), and every server answering with the model asked for."""
    from evals.arms import hub_data
    from evals.arms.backends import served_models
    from evals.arms.tasks import gpqa_data_file, gsm8k_data_files

    names = {s.name for s in specs}
    gsm8k = bool(names & GSM8K_TASKS)
    if request.data_dir is not None and gsm8k:
        gsm8k_data_files(request.data_dir)
    if request.gpqa_csv is not None and "gpqa_diamond" in names:
        gpqa_data_file(request.gpqa_csv)
    needed = {}
    if gsm8k and request.data_dir is None:
        needed["GSM8K"] = hub_data.GSM8K_HINT
    if "gpqa_diamond" in names and request.gpqa_csv is None:
        needed["GPQA-Diamond"] = hub_data.GPQA_HINT
    hub_data.require_data(needed)
    for label, source in (("candidate", request.candidate), ("baseline", request.baseline)):
        if source and is_url(source):
            models = served_models(source, timeout=min(30, request.timeout), flag=f"--{label}")
            if request.server_model and request.server_model not in models:
                raise QuantError(f"--{label} {source}: serves {', '.join(models)}, not --server-model "
                                 f"{request.server_model}")


def _check_device(device: str) -> None:
    import torch

    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise QuantError(f"--device {device!r}: not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise QuantError(f"--device {device}: CUDA is not available on this machine")
    if kind not in ("cpu", "cuda", "mps", "xpu"):
        raise QuantError(f"--device {device}: the in-process backend runs on cpu or cuda")


def _prepare_out(held, resume: bool = True) -> None:
    """Refuse (before any work) a file of someone else's where this eval writes; remove what an earlier eval of
    ours left in OUT (by its owner record, only files that still hold what it wrote), report.json first so an
    unfinished run never looks finished."""
    held.require_free((RUNS_DIR, SCRATCH_DIR) + OWN_FILES)
    if held.previous is not None and held.previous.kind == "eval":
        for name in (REPORT_JSON, RUNS_DIR) + OWN_FILES[1:]:
            held.remove_ours(name)
    if held.is_scratch(SCRATCH_DIR):  # all but the kept answers (evals/arms/answers.py), which --no-resume drops
        for entry in (held.root / SCRATCH_DIR).iterdir():
            if entry.name != ANSWERS_DIR or not resume or entry.is_symlink() or not entry.is_dir():
                remove_path(entry)


def _claim_out(request: EvalRequest):
    from quant.ownership import claim

    inputs = {"candidate": None if is_url(request.candidate) else Path(request.candidate),
              "baseline": None if not request.baseline or is_url(request.baseline) else Path(request.baseline),
              "--data-dir": request.data_dir, "--gpqa-csv": request.gpqa_csv, "--baseline-run": request.baseline_run}
    return claim(Path(request.out), "eval", inputs=inputs, overwrite=request.overwrite, what="--out")


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


RUN_SETTINGS = ("limit", "seeds", "max_gen_toks", "temperature", "top_p", "mtp_depth", "thinking")


def _settings(request: EvalRequest, specs) -> dict:
    from importlib.metadata import version

    return {"tasks": [s.name for s in specs], "limit": request.limit, "seeds": request.seeds,
            "max_gen_toks": request.max_gen_toks, "temperature": request.temperature, "top_p": request.top_p,
            "mtp": request.mtp, "mtp_depth": request.mtp_depth, "mtp_margin_points": request.mtp_margin,
            "endpoint": request.endpoint, "thinking": request.thinking, "ci_level": 0.95, "ci_method": "tango-score",
            "lm_eval_version": version("lm_eval")}


def load_baseline_run(run: Path, specs, settings: dict) -> tuple[dict, list[dict], dict | None]:
    """The baseline arm of an earlier `quant eval` output (its report.json, per-question samples and the identity of
    the model that answered, None for an output written before identities were), checked to have run the same
    tasks with the same generation settings; prompts are checked again when pairing."""
    report_path = Path(run) / REPORT_JSON
    try:
        earlier = json.loads(report_path.read_text())
    except (OSError, ValueError) as e:
        raise QuantError(f"--baseline-run {run}: no finished eval output here ({report_path}: {e})")
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


def compare_records(baseline: list[dict], candidate: list[dict], specs, request: EvalRequest
                    ) -> list[ComparisonRow]:
    """One report row per task and lm-eval filter."""
    rows = []
    for spec in specs:
        for filter_name in spec.filters:
            paired = pair_scores(baseline, candidate, spec.name, filter_name)
            comparison = accuracy.compare(paired.baseline, paired.candidate, margin=request.margin / 100.0,
                                       samples_per_question=len(paired.seeds))
            primary = filter_name == spec.primary_filter
            acceptance = pair_acceptance(baseline, candidate, spec.name, filter_name) if primary else None
            rows.append(ComparisonRow(
                task=spec.name, label=spec.label, filter=filter_name, primary=primary, seeds=paired.seeds,
                comparison=comparison, recovery=recovery(paired.baseline, paired.candidate),
                acceptance=compare_acceptance(*acceptance, margin=request.mtp_margin / 100.0) if acceptance else None,
                baseline_generations=generation_counts(baseline, spec.name, filter_name),
                candidate_generations=generation_counts(candidate, spec.name, filter_name),
            ))
    return rows


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
            mtp = _server_mtp(server_spec, records, specs, settings, options, log, store) if server_spec else \
                {"measured": False, "why": "MTP not measured (--mtp off)"}
        else:
            mtp = _measure_mtp(backend, records, depth, log)
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


def _server_mtp(spec, records: list[dict], specs, settings: RunSettings, options: BackendOptions, log,
                store=None) -> dict:
    """A server arm's acceptance (evals/arms/server_metrics.py): vLLM's counters over the run, or SGLang's per-request
    meta_info from a greedy /generate replay of every greedy generation (attached to its records; each replay kept
    in `store` as it arrives, like the answers, so a resumed run replays only what is missing)."""
    from evals.arms import server_metrics as server_spec

    if spec.kind is None:
        return {"measured": False, "why": spec.why}
    if spec.kind == "vllm":
        return server_spec.vllm_arm(spec)
    greedy = {s.name: s for s in specs if not s.sampled}
    replayed: dict[tuple, dict] = {}
    for r in records:
        key = (r["task"], r["seed"], r["doc_id"])
        if r["task"] not in greedy or key in replayed or r.get("prompt") is None:
            continue
        max_new = settings.gen_kwargs(greedy[r["task"]])["max_gen_toks"]
        counts = _kept_replay(store, spec, r["prompt"], max_new, r.get("until") or [], options.timeout)
        replayed[key] = {"positions": 0, "accepted_depth1": 0, **counts, "depth": None}
    for r in records:
        r["mtp"] = replayed.get((r["task"], r["seed"], r["doc_id"]))
    if not replayed:
        return {"measured": False, "why": "no greedy task with a completion prompt to replay through SGLang's "
                                          "/generate (chat prompts are not replayed)"}
    rounds = sum(q["rounds"] for q in replayed.values())
    tokens = sum(q["tokens"] for q in replayed.values())
    log(f"  SGLang accepted length {tokens / max(rounds, 1):.2f} over {len(replayed)} replayed generations")
    return {"measured": True, "source": "SGLang /generate meta_info (completion_tokens / spec_verify_ct), greedy "
                                        "replay of each generation", "generations": len(replayed),
            "mean_accepted_length": tokens / rounds if rounds else None,
            "speculative_algorithm": (spec.info or {}).get("speculative_algorithm"),
            "depth": (spec.info or {}).get("speculative_num_steps")}


def _kept_replay(store, spec, prompt: str, max_new: int, until: list[str], timeout: float) -> dict:
    from evals.arms import server_metrics
    from evals.arms.answers import request_key

    key = request_key(store.digest, "sglang_generate", (prompt, max_new, until), 0) if store else None
    kept = store.get(key) if store else None
    if kept is not None:
        return json.loads(kept)
    counts = server_metrics.sglang_replay(spec, prompt, max_new, until, timeout)
    if store:
        store.put(key, json.dumps(counts))
        store.commit()
    return counts


def _measure_mtp(backend: Backend, records: list[dict], depth: int, log) -> dict:
    """Attach each generation's MTP acceptance to its records (every filter of it); what was measured, or why
    nothing was."""
    if backend.draft is None:
        return {"measured": False, "why": backend.draft_note or "no MTP draft"}
    from evals.arms.mtp_measure import measure_records

    log(f"  {backend.label}: MTP draft acceptance (depth {depth}, {len(backend.draft.layers)} MTP layer(s))")
    measured = measure_records(backend.lm, backend.draft, records, depth, log=log)
    for r in records:
        q = measured.get((r["task"], r["seed"], r["doc_id"]))
        r["mtp"] = q.to_json() if q else None
    return {"measured": True, "source": "in-process draft (evals/arms/mtp_draft.py), greedy verification",
            "depth": depth, "layers": len(backend.draft.layers)}


def evaluate(request: EvalRequest, log=print) -> EvalReport:
    """Run the comparison and write the report; returns the report (`report.verdict`; `report.to_json()` is what
    report.json holds)."""
    with digests_for_this_run():  # each checkpoint hashed once in this run (the check below, then its arm)
        return _evaluate_checked(request, log)


def _evaluate_checked(request: EvalRequest, log) -> EvalReport:
    _check(request)
    specs = parse_tasks(request.tasks)
    _check_chat(request, specs)
    settings = _settings(request, specs)
    earlier = load_baseline_run(request.baseline_run, specs, settings) if request.baseline_run else None
    gate = _read_gate(request, specs)
    owner = _claim_out(request)
    owner.check()  # a foreign --out, or an input inside it, is refused before the servers are asked
    _check_inputs(request, specs)
    with owner as held:
        # Under --out's lock (a second eval into it is refused first), before anything in it is removed; a refusal
        # leaves a new --out as it found it (not there).
        _check_not_itself(request, earlier)
        _prepare_out(held, request.resume)
        try:
            report = _evaluate(request, specs, settings, earlier, held, log, gate)
        except Exception as e:  # a full or read-only disk met inside lm-eval or datasets: exit 74 naming OUT
            failure = machine_failure(e)
            if failure is None or isinstance(e, QuantError):
                raise
            raise naming(failure, held.root) from e
    if request.write_gate is not None:
        spec = next((s for s in specs if s.name == "gsm8k"), specs[0])
        write_gate(request.write_gate, gate_from_baseline(report, spec, request.margin, request.mtp_margin,
                                                          request.candidate_name))
    return report


def _check_not_itself(request: EvalRequest, earlier) -> None:
    """Refuse, before any evaluation, a candidate compared with its own model by content, not by path: a baseline
    checkpoint byte for byte the candidate's (evals.arms.answers.checkpoint_digest), or --baseline-run answers that
    the candidate's model gave (the identity that run wrote beside them; a run from before identities were written
    is known by its baseline's path or URL)."""
    from evals.arms.answers import checkpoint_digest, same_model

    proves = "a comparison of a model with itself proves nothing"
    if request.baseline is not None:
        if is_url(request.candidate) or is_url(request.baseline):
            return  # two servers: by URL (_check); a server and a checkpoint: an engine's check, not a self-comparison
        digest = checkpoint_digest(Path(request.candidate))
        if digest == checkpoint_digest(Path(request.baseline)):
            raise QuantError(f"--candidate {request.candidate} and --baseline {request.baseline} are the same model "
                             f"(byte-identical checkpoints, sha256 {digest[:16]}); {proves}")
        return
    arm, _, recorded = earlier
    source = arm.get("source")
    if recorded is None:  # an output written before identities were: its baseline's path or URL
        same = source is not None and (arm.get("kind") == "server") == is_url(request.candidate) and \
            _same_source(str(source), request.candidate)
        what = "the same path" if not is_url(request.candidate) else "the same server"
    else:
        candidate = _candidate_identity(request) if recorded.get("kind") == ("server" if is_url(request.candidate)
                                                                               else "transformers") else {}
        same = same_model(recorded, candidate)
        what = (f"the same checkpoint bytes, sha256 {str(recorded.get('checkpoint_digest'))[:16]}"
                if recorded.get("checkpoint_digest") and candidate.get("checkpoint_digest")
                else "the same server and model id")
    if same:
        raise QuantError(f"--baseline-run {request.baseline_run}: its baseline answers were given by --candidate "
                         f"{request.candidate} itself ({source}: {what}); {proves}")


def _candidate_identity(request: EvalRequest) -> dict:
    """The candidate's model as evals.arms.answers identifies it, before its arm runs."""
    from evals.arms.answers import checkpoint_digest, server_identity

    if not is_url(request.candidate):
        return {"kind": "transformers", "checkpoint_digest": checkpoint_digest(Path(request.candidate))}
    from evals.arms.backends import endpoint_url, served_models

    url = endpoint_url(request.candidate, request.endpoint)
    model = request.server_model or served_models(url, timeout=min(30, request.timeout), flag="--candidate")[0]
    return server_identity(url, model)


def _read_gate(request: EvalRequest, specs):
    """The --gate file, checked against this run before any work; --write-gate's target, checked likewise (a new
    file outside every input, or --overwrite)."""
    if request.write_gate is not None:
        _check_gate_target(request)
    if request.gate is None:
        return None
    gate = read_gate(request.gate)
    check_run(gate, request.gate, specs, request.limit, request.mtp)
    return gate


def _check_gate_target(request: EvalRequest) -> None:
    from quant.ownership import check_new_file

    inputs = {label: Path(source) for label, source in (("candidate checkpoint", request.candidate),
                                                         ("baseline checkpoint", request.baseline))
              if source and not is_url(source)}
    check_new_file(Path(request.write_gate), "--write-gate", inputs, request.overwrite)


def _apply_gate(report: EvalReport, gate) -> None:
    """The gate's checks go into the report; a miss makes the verdict a fail (an invalid run stays invalid: it is
    no evidence either way)."""
    report.gate = apply_gate(gate, report)
    if not report.gate["passed"] and report.verdict != Verdict.INVALID:
        report.verdict, report.exit_code = Verdict.FAIL, EXIT_CODES[Verdict.FAIL]


def _evaluate(request: EvalRequest, specs, settings: dict, earlier, held, log, gate=None) -> EvalReport:
    out, scratch = held.root, held.root / SCRATCH_DIR
    scratch.mkdir(exist_ok=True)
    datasets_cache = scratch / "hf_datasets_cache"
    gsm8k_dir, gpqa_csv = _eval_data(request, specs, scratch / "data")
    task_dir = write_task_files(scratch / "tasks", specs, gsm8k_dir=gsm8k_dir, toy_dir=request.toy_data_dir,
                                gpqa_csv=gpqa_csv, datasets_cache=datasets_cache, thinking=request.thinking)
    go_offline(datasets_cache)
    run_settings = RunSettings(limit=request.limit, max_gen_toks=request.max_gen_toks, seeds=request.seeds,
                               temperature=request.temperature, top_p=request.top_p, thinking=request.thinking)
    options = BackendOptions(endpoint=request.endpoint, server_model=request.server_model,
                             concurrency=request.concurrency, max_retries=request.max_retries,
                             timeout=request.timeout, max_gen_toks=request.max_gen_toks or 512,
                             batch_size=request.batch_size, device=request.device, dtype=request.dtype,
                             mtp=request.mtp, activations=request.activations)
    if earlier:
        baseline_arm, baseline, identity = earlier
        baseline_arm = {**baseline_arm, "reused_from": str(request.baseline_run)}
        write_records(scratch / RUNS_DIR / "baseline", specs, baseline)
        if identity is not None:  # passed on: a run reusing these answers again knows whose they are
            write_identity(scratch / RUNS_DIR / "baseline", identity)
        log(f"baseline: reusing the samples of {request.baseline_run}")
    else:
        baseline_arm, baseline = _run("baseline", request.baseline, request.baseline_name, specs, task_dir, scratch,
                                      run_settings, options, request.mtp_depth, log)
    evidence.check_failures("baseline", baseline_arm, _generations(baseline))  # before the candidate arm runs
    candidate_arm, candidate = _run("candidate", request.candidate, request.candidate_name, specs, task_dir, scratch,
                                    run_settings, options, request.mtp_depth, log)
    evidence.check_failures("candidate", candidate_arm, _generations(candidate))
    for name in ("work", "hf_datasets_cache"):
        shutil.rmtree(scratch / name, ignore_errors=True)
    os.replace(scratch / RUNS_DIR, out / RUNS_DIR)  # no runs/ stands there: refused or removed on entry
    held.add([RUNS_DIR])  # both arms' samples, in place (and ours) before they are paired

    report = _report(request, specs, settings, baseline_arm, candidate_arm,
                     compare_records(baseline, candidate, specs, request))
    if gate is not None:
        _apply_gate(report, gate)
    write_report(report, out, record=held.add)
    return report


def _report(request: EvalRequest, specs, settings: dict, baseline_arm: dict, candidate_arm: dict,
            rows: list[ComparisonRow]) -> EvalReport:
    """The verdict over the rows (invalid when an arm is at its floor; else every primary comparison's and every
    acceptance comparison's, combined), and what would decide it when inconclusive."""
    problems = evidence.floor_problems(rows, {s.name: s.floor for s in specs})
    verdict = Verdict.INVALID if problems else \
        accuracy.combine_verdicts([r.comparison.verdict for r in rows if r.primary]
                                  + [r.acceptance.verdict for r in rows if r.acceptance])
    return EvalReport(verdict=verdict, exit_code=EXIT_CODES[verdict], margin_points=request.margin,
                      mtp_margin_points=request.mtp_margin, problems=problems,
                      next_steps=evidence.next_steps(rows, request.limit, {s.name: s.size for s in specs})
                      if verdict == Verdict.INCONCLUSIVE else [],
                      baseline=baseline_arm, candidate=candidate_arm, settings=settings, rows=rows, methods=METHODS)


def _eval_data(request: EvalRequest, specs, dest: Path) -> tuple[Path | None, Path | None]:
    """Local data the user gave, else the tasks' datasets from the hub (before the run goes offline)."""
    from evals.arms import hub_data
    from evals.arms.tasks import GPQA_COLUMNS

    names = {s.name for s in specs}
    gsm8k_dir = request.data_dir
    if gsm8k_dir is None and names & GSM8K_TASKS:
        gsm8k_dir = hub_data.fetch_gsm8k(dest / "gsm8k")
    gpqa_csv = request.gpqa_csv
    if gpqa_csv is None and "gpqa_diamond" in names:
        gpqa_csv = hub_data.fetch_gpqa_diamond(dest / "gpqa_diamond.csv", GPQA_COLUMNS)
    return gsm8k_dir, gpqa_csv
