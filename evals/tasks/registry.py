"""The registry of eval tasks: every record in the task directory (records/, or the directory QUANT_EVAL_TASKS
names), by name. `--tasks`, its --help text, the README's task list and the request's checks all read it.

Adding a task is adding a record (records/<name>.yaml; evals/tasks/record.py says what it holds) and its row in
the README's task table; a task on a data set no record uses yet also adds its data source (data_sources.py)."""

from __future__ import annotations

import os
from pathlib import Path

from evals.tasks.record import EvalTask, read_record
from quant.errors import QuantError, did_you_mean

RECORDS_DIR = Path(__file__).resolve().parent / "records"
# A directory of task records read instead of the packaged ones: a site's own tasks, or a test's.
TASKS_DIR_ENV = "QUANT_EVAL_TASKS"


def records_dir() -> Path:
    return Path(os.environ.get(TASKS_DIR_ENV) or RECORDS_DIR)


def registry(directory: Path | None = None) -> dict[str, EvalTask]:
    """{name: task} of every record in `directory` (default: records_dir()), in name order. Read afresh on each
    call: a handful of small files, and a test or a site may point QUANT_EVAL_TASKS elsewhere between calls."""
    directory = Path(directory) if directory is not None else records_dir()
    paths = sorted(directory.glob("*.yaml"))
    if not paths:
        raise QuantError(f"{directory}: no eval task records (*.yaml) here"
                         + (f" ({TASKS_DIR_ENV} names it)" if os.environ.get(TASKS_DIR_ENV) else ""))
    tasks: dict[str, EvalTask] = {}
    lm_eval_names: dict[str, Path] = {}
    for path in paths:
        task = read_record(path)
        if task.lm_eval_task in lm_eval_names:  # two records would write the same lm-eval task file
            raise QuantError(f"{path}: task: {task.lm_eval_task} is also the task of "
                             f"{lm_eval_names[task.lm_eval_task].name}; each record names its own")
        lm_eval_names[task.lm_eval_task] = path
        tasks[task.name] = task
    return tasks


def parse_tasks(value: str) -> list[EvalTask]:
    """`"gsm8k,gpqa_diamond"` -> tasks, in the order given; QuantError naming an unknown task."""
    known = registry()
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise QuantError("--tasks is empty; choose from " + ", ".join(known))
    unknown = [n for n in names if n not in known]
    if unknown:
        raise QuantError(f"unknown task {unknown[0]!r}{did_you_mean(unknown[0], known)}; choose from "
                         f"{', '.join(known)}")
    return [known[n] for n in dict.fromkeys(names)]


def tasks_help() -> str:
    """`gpqa_diamond (GPQA-Diamond CoT), gsm8k (GSM8K 5-shot), ...`: the --tasks choices."""
    return ", ".join(f"{t.name} ({t.label})" for t in registry().values())


def budgets_help() -> str:
    """`gpqa_diamond 32768, gsm8k_boxed 2048 (16384 with --thinking on), ...`: each task's default budget."""
    return ", ".join(f"{t.name} {t.budget}" for t in registry().values())
