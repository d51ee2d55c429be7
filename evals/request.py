"""What `quant eval` is asked (EvalRequest), checked before any work: the arguments themselves, the chat and
thinking switches against the tasks, then the inputs (the data files, the hub's data, the servers)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from evals.arms.backends import ACTIVATIONS, DTYPES, is_url, served_models
from evals.arms.data_files import data_files
from evals.arms.tasks import THINKING_MODES
from evals.tasks.data_sources import EVAL_DATA_DIR, sources_of
from evals.tasks.registry import registry
from quant.errors import QuantError

MAX_MARGIN_POINTS = 50.0  # a margin wider than this admits any candidate: refused as a mistake


@dataclass(frozen=True)
class EvalRequest:
    """What `quant eval` is asked. These defaults are the command line's too (evals/command.py reads them)."""

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


def check(request: EvalRequest) -> None:
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
    _check_sources(request)
    for flag, path in (("--data-dir", request.data_dir), ("--gpqa-csv", request.gpqa_csv),
                       ("--baseline-run", request.baseline_run)):
        if path is not None and not Path(path).exists():
            raise QuantError(f"{flag} {path}: not found")


def _check_sources(request: EvalRequest) -> None:
    """Two different models, each a checkpoint directory (intact, with activations this eval can model) or a URL."""
    sources = [("candidate", request.candidate)] + ([("baseline", request.baseline)] if request.baseline else [])
    if request.baseline and same_source(request.candidate, request.baseline):
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


def same_source(a: str, b: str) -> bool:
    if is_url(a) or is_url(b):
        from evals.arms.backends import api_root

        return is_url(a) and is_url(b) and api_root(a) == api_root(b)
    return Path(a).resolve() == Path(b).resolve()


def check_chat(request: EvalRequest, specs) -> None:
    """Chat tasks need a server's chat endpoint; --thinking needs every task asked through a chat template."""

    servers = [s for s in (request.candidate, request.baseline) if s and is_url(s)]
    for spec in specs:
        if spec.chat and servers and request.endpoint != "chat":
            raise QuantError(f"--tasks {spec.name} is a chat task: servers are asked it with --endpoint chat")
        in_process = [s for s in (request.candidate, request.baseline) if s and not is_url(s)]
        if request.thinking is not None and not spec.chat and (in_process or request.endpoint != "chat"):
            raise QuantError(f"--thinking {request.thinking}: {spec.name} is asked as a plain completion, with no chat "
                             f"template to switch thinking in (chat tasks: {chat_tasks(registry())}; or "
                             f"servers with --endpoint chat)")


def chat_tasks(tasks: dict) -> str:
    return ", ".join(name for name, task in tasks.items() if task.chat) or "none"


def check_inputs(request: EvalRequest, specs) -> None:
    """What can be checked before any work beyond the arguments: the data files, the data the hub must give
    (all of it named in one error when the hub is off), and every server answering with the model asked for."""
    from evals.arms import hub_data

    needed = {}
    for source in sources_of(specs):
        local = source.local_copy(request)
        if local is not None:
            data_files(source, local)
        elif source.hub is not None:
            needed[source.what] = source.hint
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


def run_settings(request: EvalRequest, specs) -> dict:
    """The settings report.json records (an earlier run's are checked against them by --baseline-run)."""

    return {"tasks": [s.name for s in specs], "limit": request.limit, "seeds": request.seeds,
            "max_gen_toks": request.max_gen_toks, "temperature": request.temperature, "top_p": request.top_p,
            "mtp": request.mtp, "mtp_depth": request.mtp_depth, "mtp_margin_points": request.mtp_margin,
            "endpoint": request.endpoint, "thinking": request.thinking, "ci_level": 0.95, "ci_method": "tango-score",
            "lm_eval_version": version("lm_eval")}
