"""The offline lm-eval task files generated at run time from the task records (evals/tasks/), and the functions
those files call.

Each task file is its record's lm-eval overlay: lm-eval's own YAML included (so prompts, filters and exact_match
scoring are lm-eval's) with only the dataset swapped for the data source's local files (GSM8K-format JSONL or the
GPQA-Diamond CSV). The files are written into the run's output directory because `include:` must name the
installed lm-eval by absolute path. The records' `!function` tags name the two modules written beside them,
which re-export the functions below: GPQA's `process_docs` with the answer shuffle seeded per question (the stock
one uses the process-global RNG, frozen by whatever the datasets cache holds), and the reasoning-model filters
and math_verify scoring of gsm8k_boxed (its record cites SGLang's nightly, which it follows). The stock shuffle:
lm-evaluation-harness lm_eval/tasks/gpqa/*/utils.py; the same fix: modelscope/evalscope PR #1583.

A reasoning model's thinking never reaches answer extraction: a server's reasoning parser returns it as
`reasoning_content`, which lm-eval's chat client does not read, and what is left of the template's think tags in a
response (`<think>...</think>`, or a generation that never closed the tag its prompt opened) is cut by the first
step of every filter (`strip_reasoning`) when the run sets `--thinking` or the task's record does it itself.
"""

from __future__ import annotations

import copy
import hashlib
import random
import re
from pathlib import Path
from typing import Mapping

import yaml

from evals.arms.data_files import DATASET_PATH, GPQA_COLUMNS, data_files
from evals.tasks.data_sources import DATA_SOURCES
from evals.tasks.lm_eval_yaml import FUNCTION_TAG, lm_eval_dir, merged_config
from evals.tasks.record import EvalTask
from quant.errors import QuantError

REASONING_UTILS_MODULE = "reasoning_local_utils"
# The modules the records' `!function` tags name, written beside the task files: each re-exports from here.
FUNCTION_MODULES = {
    "gpqa_local_utils": ("GPQA process_docs with a per-question seeded answer shuffle",
                         "gpqa_process_docs as process_docs"),
    REASONING_UTILS_MODULE: ("the reasoning-model filters and the math_verify scoring",
                             "boxed_answers, process_boxed, strip_reasoning"),
}
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
THINKING_MODES = ("on", "off")


def _clean_choice(text) -> str:
    # lm-eval's GPQA preprocess (tasks/gpqa/*/utils.py), kept identical so prompts match the stock task.
    if text is None:
        return " "
    return str(text).strip().replace(" [title]", ". ").replace("  ", " ")


def gpqa_choice_order(question: str) -> list[int]:
    """Permutation of the four answers [wrong1, wrong2, wrong3, correct], seeded by sha256 of the question."""
    order = [0, 1, 2, 3]
    random.Random(int(hashlib.sha256(question.encode()).hexdigest()[:16], 16)).shuffle(order)
    return order


def gpqa_process_docs(dataset):
    """lm-eval's GPQA `process_docs`, with the answer shuffle seeded per question instead of by global state."""

    def one(doc):
        answers = [_clean_choice(doc[c]) for c in GPQA_COLUMNS[2:]] + [_clean_choice(doc["Correct Answer"])]
        choices = [answers[i] for i in gpqa_choice_order(doc["Question"])]
        correct = choices.index(answers[3])
        return {"choice1": choices[0], "choice2": choices[1], "choice3": choices[2], "choice4": choices[3],
                "choices": choices, "answer": f"({chr(65 + correct)})"}

    return dataset.map(one)


# ------------------------------------------------------------------------------------------ reasoning models


def split_reasoning(text: str, opened: bool = False) -> tuple[str, str]:
    """(reasoning, answer) of a generation. Up to the last `</think>` is reasoning; with no `</think>`, a generation
    that opened `<think>` (or whose prompt did: `opened`, the chat template's generation prompt) never left its
    reasoning and has no answer. Otherwise it is all answer. A server's reasoning parser splits the same way."""
    if THINK_CLOSE in text:
        head, _, tail = text.rpartition(THINK_CLOSE)
        return head.replace(THINK_OPEN, "", 1).strip(), tail.strip()
    if opened or THINK_OPEN in text:
        return text.replace(THINK_OPEN, "", 1).strip(), ""
    return "", text


def strip_reasoning(resps, docs):
    """lm-eval custom filter: every response without its reasoning (`split_reasoning`)."""
    return [[split_reasoning(r)[1] for r in group] for group in resps]


def last_boxed(text: str) -> str:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) of `text`, braces balanced; "" when there is
    none or it never closes."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return ""
    brace = text.find("{", start)
    if brace < 0 or text[start:brace].strip() not in ("\\boxed", "\\fbox"):
        return ""
    depth = 0
    for i in range(brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[brace + 1:i].strip()
    return ""


def boxed_answers(resps, docs):
    """lm-eval custom filter: the last boxed answer of every response."""
    return [[last_boxed(r) for r in group] for group in resps]


def gsm8k_gold(answer: str) -> str:
    """GSM8K's reference number: what follows `####`, without thousands separators."""
    return answer.split("####")[-1].strip().replace(",", "")


def math_verify_score(gold: str, extracted: str) -> float:
    """1.0 when math_verify finds the boxed answer equal to the gold number (as sgl-eval grades), else 0.0."""
    if not extracted:
        return 0.0
    from math_verify import parse, verify

    try:
        return float(bool(verify(parse(f"\\boxed{{{gold}}}"), parse(f"\\boxed{{{extracted}}}"))))
    except Exception:  # math_verify raises on what it cannot parse (and on its own timeouts): not a match
        return 0.0


def process_boxed(doc: dict, results: list[str]) -> dict:
    """lm-eval process_results of gsm8k_boxed: `results` are the filtered responses (the boxed answers)."""
    return {"exact_match": math_verify_score(gsm8k_gold(doc["answer"]), results[0] if results else "")}


def _without_reasoning(filters: list[dict]) -> list[dict]:
    """Each filter pipeline with `strip_reasoning` as its first step (a pipeline that starts with it already, as
    a chat task's record writes it, is kept as it is)."""
    step = {"function": "custom", "filter_fn": f"{FUNCTION_TAG} {REASONING_UTILS_MODULE}.strip_reasoning"}
    return [f if (f.get("filter") or [None])[0] == step else {**f, "filter": [step] + list(f.get("filter") or [])}
            for f in filters]


def write_task_files(task_dir: Path, tasks: list[EvalTask], *, data: Mapping[str, Path | None],
                     datasets_cache: Path, thinking: str | None = None) -> Path:
    """Write one YAML per task (plus the modules its `!function` tags name) into `task_dir`; returns `task_dir`.
    `data`: {data source name: its local copy}. With `thinking` set, every task's filters first cut the reasoning
    out (a chat task's record does it always)."""
    lm_eval = lm_eval_dir()
    task_dir.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        config = {
            "include": str(lm_eval / task.include),
            "task": task.lm_eval_task,
            "tag": [],  # otherwise the task inherits a group tag such as math_word_problems
            "dataset_name": None,
            **copy.deepcopy(dict(task.overlay)),
        }
        if thinking is not None:
            filters = config.get("filter_list") or merged_config(lm_eval / task.include).get("filter_list") or []
            config["filter_list"] = _without_reasoning(filters)
        source = DATA_SOURCES[task.data]
        local = data.get(source.name)
        if local is None:
            raise QuantError(f"--tasks {task.name} needs {source.flag} (the {source.what} data)")
        config["dataset_path"] = DATASET_PATH[source.format]
        config["dataset_kwargs"] = {"data_files": data_files(source, local), "cache_dir": str(datasets_cache)}
        text = yaml.safe_dump(config, sort_keys=False, width=1000)
        # `!function` is a YAML tag, not a string: unquote it after dumping.
        text = re.sub(r"'(!function [\w.]+)'", r"\1", text)
        (task_dir / f"{task.lm_eval_task}.yaml").write_text(text)
    for module, (what, names) in FUNCTION_MODULES.items():
        (task_dir / f"{module}.py").write_text(f'"""Generated by evals.arms.tasks: {what}."""\n'
                                               f"from evals.arms.tasks import {names}  # noqa: F401\n")
    return task_dir
