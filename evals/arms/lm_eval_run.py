"""Drive `lm_eval.simple_evaluate` for one model (an "arm") over the chosen tasks, offline, and persist every
per-question record so the comparison can pair answers question by question.

Both arms get identical seeds (python 0, numpy 1234, few-shot 1234) so they see the same few-shot examples.
Sampled tasks (GPQA) run once per generation seed; the seed reaches the sampler through the backend (torch seed
in process, `seed` in the request payload for servers).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from evals.arms.answers import kept_answers
from evals.arms.backends import FAILED_GENERATION, Backend
from evals.tasks.record import EvalTask
from quant.errors import QuantError

SAMPLES_FILE = "samples.jsonl"
RESULTS_FILE = "results.json"
OFFLINE_ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# lm-eval's defaults, pinned so both arms (and reruns) agree whatever lm-eval's defaults become.
PYTHON_SEED, NUMPY_SEED, FEWSHOT_SEED = 0, 1234, 1234
GREEDY_TORCH_SEED = 1234


def go_offline(datasets_cache: Path) -> None:
    """No hub access from here on; datasets caches into the run's own directory.

    The environment is read when `datasets` / `huggingface_hub` are imported, so the flags are also set on the
    already-imported modules (tests and long-lived processes import them early)."""
    os.environ.update(OFFLINE_ENV)
    os.environ["HF_DATASETS_CACHE"] = str(datasets_cache)
    import datasets.config
    import huggingface_hub.constants

    datasets.config.HF_HUB_OFFLINE = True
    datasets.config.HF_DATASETS_OFFLINE = True
    huggingface_hub.constants.HF_HUB_OFFLINE = True


@dataclass(frozen=True)
class RunSettings:
    limit: int | None
    max_gen_toks: int | None     # None: the task's default
    seeds: int                   # generation seeds for sampled tasks
    temperature: float = 1.0     # sampled tasks only; greedy tasks always decode greedily
    top_p: float = 1.0
    thinking: str | None = None  # "on" / "off": the chat template's thinking switch; None: the template's default

    def seed_list(self, spec: EvalTask) -> list[int]:
        return list(range(self.seeds)) if spec.sampled else [0]

    def gen_kwargs(self, spec: EvalTask) -> dict:
        default = spec.thinking_max_gen_toks if self.thinking == "on" and spec.thinking_max_gen_toks else \
            spec.default_max_gen_toks
        max_gen_toks = self.max_gen_toks or default
        if spec.sampled:
            # do_sample must be explicit: HF and vLLM would otherwise follow a YAML's do_sample and ignore
            # the temperature (lm-evaluation-harness lm_eval/models/utils.py normalize_gen_kwargs).
            return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p,
                    "max_gen_toks": max_gen_toks}
        return {"do_sample": False, "temperature": 0.0, "max_gen_toks": max_gen_toks}


# lm-eval's warnings about what this tool does on purpose, which read as the user's mistake: an initialized model
# handed to HFLM in a single process (lm_eval/models/huggingface.py:220, :495), and greedy generation settings given
# for every task (lm_eval/evaluator.py:227, "Ensure 'do_sample=True'": sampled tasks do get do_sample=True).
EXPECTED_WARNINGS = {"lm_eval.models.huggingface": ("`pretrained` model kwarg is not of type `str`",
                                                    "Passed an already-initialized model through `pretrained`"),
                     "lm_eval.evaluator": ("specified through cli, these settings will update set parameters",)}


class _Expected(logging.Filter):
    def __init__(self, phrases: tuple[str, ...]):
        super().__init__()
        self.phrases = phrases

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(p in str(record.msg) for p in self.phrases)


def quiet_third_parties(terminal: bool) -> None:
    """Silence lm-eval's warnings about this tool's deliberate choices (EXPECTED_WARNINGS); off a terminal (a log
    file, a pipe), also the progress bars of tqdm, datasets and huggingface_hub, which write one `\r`-joined line
    there: the eval's own lines say what ran, how many and how long (run_arm)."""
    for name, phrases in EXPECTED_WARNINGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Expected) for f in logger.filters):
            logger.addFilter(_Expected(phrases))
    if not terminal:
        for variable in ("TQDM_DISABLE", "HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS"):
            os.environ.setdefault(variable, "1")


@contextlib.contextmanager
def _no_bar_off_a_terminal(lm):
    """lm-eval's HFLM draws its generation bar with an explicit `disable=disable_tqdm` (huggingface.py:1574), which
    no environment variable reaches: off a terminal, its generate_until is called with disable_tqdm=True."""

    original = getattr(lm, "generate_until", None)
    if sys.stderr.isatty() or original is None or "disable_tqdm" not in inspect.signature(original).parameters:
        yield
        return
    lm.generate_until = lambda requests, *args, **kwargs: original(requests, *args,
                                                                   **{"disable_tqdm": True, **kwargs})
    try:
        yield
    finally:
        lm.__dict__.pop("generate_until", None)


@contextlib.contextmanager
def _light_provenance():
    """simple_evaluate ends every call (here: every task and seed) with torch's full environment report
    (collect_env: seconds of pip and nvidia-smi subprocesses) and `git describe` of the working directory (which
    prints "fatal: not a git repository" outside one). Record the library versions instead, during our calls."""
    import lm_eval.evaluator as evaluator

    def versions_only(storage: dict) -> None:
        storage.update({"lm_eval_version": version("lm_eval"), "transformers_version": version("transformers")})

    originals = evaluator.add_env_info, evaluator.get_git_commit_hash
    evaluator.add_env_info, evaluator.get_git_commit_hash = versions_only, lambda: None
    try:
        yield
    finally:
        evaluator.add_env_info, evaluator.get_git_commit_hash = originals


def sample_record(spec: EvalTask, seed: int, sample: dict) -> dict:
    """The part of one lm-eval sample the comparison needs, JSON-ready."""
    response = sample["resps"][0][0] if sample["resps"] and sample["resps"][0] else ""
    arguments = sample.get("arguments") or [[None]]
    prompt = arguments[0][0] if arguments and arguments[0] else None
    gen_args = arguments[0][1] if arguments and len(arguments[0]) > 1 and isinstance(arguments[0][1], dict) else {}
    extracted = sample["filtered_resps"][0] if sample["filtered_resps"] else ""
    return {
        "task": spec.name,
        "seed": seed,
        "filter": sample["filter"],
        "doc_id": int(sample["doc_id"]),
        "doc_hash": sample["doc_hash"],
        "prompt_hash": sample["prompt_hash"],
        "target": str(sample["target"]),
        "prompt": prompt if isinstance(prompt, str) else None,  # the context lm-eval generated from
        "until": [u for u in gen_args.get("until") or [] if isinstance(u, str)],  # its stop strings
        "response": str(response),
        "extracted": str(extracted),
        "score": float(sample["exact_match"]),
        "failed": response == FAILED_GENERATION,
        "empty": not str(response).strip(),
    }


def template_kwargs(thinking: str | None) -> dict:
    """The chat-template switch for `--thinking`: `enable_thinking` (Qwen3, GLM) and `thinking` (DeepSeek-V3.1,
    Kimi), as SGLang's run_eval passes both; a template ignores the one it does not read."""
    if thinking is None:
        return {}
    on = thinking == "on"
    return {"enable_thinking": on, "thinking": on}


def _chat(backend: Backend, spec: EvalTask, settings: RunSettings) -> bool:
    """Whether this task is asked as chat messages by this arm; prepares the arm's chat template switch."""
    chat = backend.chat or spec.chat
    if not chat:
        if settings.thinking is not None:
            raise QuantError(f"--thinking {settings.thinking}: {spec.name} is asked as a plain completion here; "
                             f"thinking is a chat template's switch (--endpoint chat, or a chat task)")
        return False
    if backend.kind == "server":
        if not backend.chat:
            raise QuantError(f"{spec.name} is a chat task: ask {backend.source} with --endpoint chat")
        return True
    if not getattr(backend.lm.tokenizer, "chat_template", None):
        raise QuantError(f"{spec.name} is asked as chat, but the tokenizer of {backend.source} has no chat template")
    backend.lm.chat_template_args = template_kwargs(settings.thinking)  # HFLM renders the template with these
    return True


def _check_context(backend: Backend, spec: EvalTask, max_gen_toks: int) -> None:
    if backend.kind != "transformers":
        return  # the server tokenizes and enforces its own context length
    context = backend.lm.max_length
    if max_gen_toks >= context:
        raise QuantError(f"{spec.name}: max_gen_toks {max_gen_toks} leaves no room for the prompt in the "
                         f"{context}-token context of {backend.source}; lower --max-gen-toks")


def run_dir_name(spec: EvalTask, seed: int) -> str:
    return f"{spec.name}-seed{seed}" if spec.sampled else spec.name


def write_records(out_dir: Path, specs: list[EvalTask], records: list[dict]) -> None:
    """One samples.jsonl per task (and seed) under `out_dir`, as run_arm writes them."""
    for spec in specs:
        for seed in sorted({r["seed"] for r in records if r["task"] == spec.name}):
            run_dir = out_dir / run_dir_name(spec, seed)
            run_dir.mkdir(parents=True, exist_ok=True)
            with open(run_dir / SAMPLES_FILE, "w") as f:
                for r in records:
                    if r["task"] == spec.name and r["seed"] == seed:
                        f.write(json.dumps(r) + "\n")


def run_arm(backend: Backend, specs: list[EvalTask], task_dir: Path, out_dir: Path, settings: RunSettings,
            log=print, store=None) -> list[dict]:
    """Evaluate `backend` on every task (and seed); write samples and lm-eval results under `out_dir`. With
    `store` (evals.arms.answers.AnswerStore), answers kept by an earlier run are reused and new ones kept."""
    import lm_eval
    from lm_eval.tasks import TaskManager


    task_manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    records = []
    runs = [(spec, seed) for spec in specs for seed in settings.seed_list(spec)]
    started = time.monotonic()
    for done, (spec, seed) in enumerate(runs):
        run_dir = out_dir / run_dir_name(spec, seed)
        run_dir.mkdir(parents=True, exist_ok=True)
        gen_kwargs = settings.gen_kwargs(spec)
        _check_context(backend, spec, gen_kwargs["max_gen_toks"])
        chat = _chat(backend, spec, settings)
        if spec.sampled:
            gen_kwargs.update(backend.seed_gen_kwargs(seed))
        if chat and backend.kind == "server" and settings.thinking is not None:
            gen_kwargs["chat_template_kwargs"] = template_kwargs(settings.thinking)  # SGLang's and vLLM's field
        log(f"  {backend.label}: {spec.name}" + (f" seed {seed}" if spec.sampled else ""))
        keeping = kept_answers(backend, store, seed, spec.sampled, log) if store else contextlib.nullcontext()
        with _light_provenance(), _no_bar_off_a_terminal(backend.lm), keeping:
            results = lm_eval.simple_evaluate(
                model=backend.lm,
                tasks=[spec.lm_eval_task],
                task_manager=task_manager,
                limit=settings.limit,
                gen_kwargs=gen_kwargs,
                apply_chat_template=chat,
                log_samples=True,
                bootstrap_iters=0,
                random_seed=PYTHON_SEED,
                numpy_random_seed=NUMPY_SEED,
                torch_random_seed=seed if spec.sampled else GREEDY_TORCH_SEED,
                fewshot_random_seed=FEWSHOT_SEED,
                verbosity="ERROR",
            )
        samples = sorted(results["samples"][spec.lm_eval_task], key=lambda s: (s["filter"], s["doc_id"]))
        task_records = [sample_record(spec, seed, s) for s in samples]
        write_records(out_dir, [spec], task_records)
        summary = {k: v for k, v in results.items() if k != "samples"}
        (run_dir / RESULTS_FILE).write_text(json.dumps(summary, indent=2, default=str) + "\n")
        records.extend(task_records)
        log(_progress_line(backend.label, spec, seed, task_records, done + 1, len(runs), started))
    return records


def _progress_line(label: str, spec: EvalTask, seed: int, task_records: list[dict], done: int, total: int,
                   started: float) -> str:
    """`  baseline: gsm8k: 200 questions answered (1 of 2 runs of this arm, 0:03:10; about 0:03:10 left)`."""
    elapsed = time.monotonic() - started
    questions = len({r["doc_id"] for r in task_records})
    left = elapsed / done * (total - done)
    clock = lambda s: f"{int(s) // 3600}:{int(s) // 60 % 60:02d}:{int(s) % 60:02d}"  # noqa: E731
    return (f"  {label}: {spec.name}" + (f" seed {seed}" if spec.sampled else "")
            + f": {questions} questions answered ({done} of {total} runs of this arm, {clock(elapsed)}"
            + (f"; about {clock(left)} left for it)" if done < total else ")"))
