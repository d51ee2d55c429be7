"""The evaluation tasks and the offline lm-eval task files generated for them at run time.

Each task includes lm-eval's own YAML (so prompts, filters and exact_match scoring are lm-eval's) and only
swaps the dataset for local files: GSM8K-format JSONL (`question`/`answer`) or the GPQA-Diamond CSV. The files
are written into the run's output directory because `include:` must name the installed lm-eval by absolute path.
GPQA's stock `process_docs` shuffles the answer letters with the process-global RNG, frozen by whatever the
datasets cache holds; ours seeds the shuffle from sha256 of the question, so every run and both models see the
same letter order (stock: lm-evaluation-harness lm_eval/tasks/gpqa/*/utils.py; the same fix: modelscope/evalscope
PR #1583).

Reasoning models (issue #33): `gsm8k_boxed` is GSM8K as SGLang's nightly now asks it, zero-shot chat with the
answer in `\boxed{}` scored by math_verify. SGLang's nightly runs it through sgl-eval (sglang#27757: "zero-shot
chat, `\boxed{}` answer, `math_verify` grading"); python/sglang/test/sgl_eval.py:21-54 (sgl-project/sglang at
5bff29a) sends it as chat with max_tokens 2048 unless told otherwise and thinking through
`chat_template_kwargs`; the prompt sgl-eval renders for gsm8k is NeMo-Skills' generic/math, "Solve the following
math problem. Make sure to put the answer (and only answer) inside \boxed{}." then the problem, no examples
(sgl-project/sgl-eval#46). A reasoning model's thinking never reaches answer extraction: a server's reasoning
parser returns it as `reasoning_content`, which lm-eval's chat client does not read, and what is left of the
template's think tags in a response (`<think>...</think>`, or a generation that never closed the tag its prompt
opened) is cut by the first step of every filter (`strip_reasoning`) when the run sets `--thinking` or the task is
a chat task.
"""

from __future__ import annotations

import csv
import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from quant.errors import QuantError, did_you_mean

EVAL_DATA_DIR = Path(__file__).resolve().parent.parent / "data"
GSM8K_COLUMNS = ("question", "answer")
GSM8K_SPLITS = ("train", "test")  # test is evaluated, train is the few-shot pool
GPQA_COLUMNS = ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")
GPQA_UTILS_MODULE = "gpqa_local_utils"
PROCESS_DOCS_TAG = f"!function {GPQA_UTILS_MODULE}.process_docs"
REASONING_UTILS_MODULE = "reasoning_local_utils"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# NeMo-Skills' generic/math prompt, which sgl-eval renders for GSM8K (module docstring).
BOXED_PROMPT = "Solve the following math problem. Make sure to put the answer (and only answer) inside \\boxed{}."
THINKING_MODES = ("on", "off")


@dataclass(frozen=True)
class TaskSpec:
    """One evaluation as the user names it (`--tasks`), and how it runs."""

    name: str
    label: str                  # row label in the report
    lm_eval_task: str           # name of the generated task
    include: str                # lm-eval YAML it extends, relative to the lm_eval package
    data: str                   # "gsm8k-jsonl" or "gpqa-csv"
    filters: tuple[str, ...]    # lm-eval filters reported, primary first
    sampled: bool               # True: several seeds at temperature 1.0; False: one greedy run
    default_max_gen_toks: int
    # At or below this accuracy an arm's setup is broken, not its weights (evals/statistics/evidence.py): chance level for
    # four-choice GPQA; for free-form answers a documented minimum (a model that cannot follow the 5-shot format).
    floor: float = 0.05
    size: int | None = None     # questions in the test set (what --limit can reach)
    fewshot: int = 0            # few-shot examples per prompt (the lm-eval task it extends)
    chat: bool = False          # asked as chat messages (the model's chat template; a server's chat endpoint)
    thinking_max_gen_toks: int | None = None  # the default budget with --thinking on (None: default_max_gen_toks)

    @property
    def primary_filter(self) -> str:
        return self.filters[0]


# flexible-extract is primary: it is what the published MXFP4 model cards report and it does not hinge on the
# model reproducing the exact answer line; strict-match is reported alongside.
TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec("gsm8k", "GSM8K 5-shot", "gsm8k_local", "tasks/gsm8k/gsm8k.yaml", "gsm8k-jsonl",
                 ("flexible-extract", "strict-match"), sampled=False, default_max_gen_toks=512, size=1319, fewshot=5),
        TaskSpec("toy_arith", "toy arithmetic 5-shot", "toy_arith_local", "tasks/gsm8k/gsm8k.yaml", "gsm8k-jsonl",
                 ("flexible-extract", "strict-match"), sampled=False, default_max_gen_toks=64, size=200, fewshot=5),
        TaskSpec("gpqa_diamond", "GPQA-Diamond CoT", "gpqa_diamond_cot_zeroshot_local",
                 "tasks/gpqa/cot_zeroshot/_gpqa_cot_zeroshot_yaml", "gpqa-csv",
                 ("flexible-extract", "strict-match"), sampled=True, default_max_gen_toks=32768,
                 floor=0.25, size=198),
        # SGLang's nightly GSM8K (module docstring): 2048 tokens as sgl_eval.py sends; with thinking on, 16384, the
        # budget sgl-eval#46 measured thinking runs with (7% of them still truncated at it).
        TaskSpec("gsm8k_boxed", "GSM8K 0-shot chat boxed", "gsm8k_boxed_local", "tasks/gsm8k/gsm8k.yaml",
                 "gsm8k-jsonl", ("math-verify",), sampled=False, default_max_gen_toks=2048, size=1319, chat=True,
                 thinking_max_gen_toks=16384),
    )
}


def parse_tasks(value: str) -> list[TaskSpec]:
    """`"gsm8k,gpqa_diamond"` -> specs, in the order given; QuantError naming an unknown task."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise QuantError("--tasks is empty; choose from " + ", ".join(TASKS))
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise QuantError(f"unknown task {unknown[0]!r}{did_you_mean(unknown[0], TASKS)}; choose from {', '.join(TASKS)}")
    return [TASKS[n] for n in dict.fromkeys(names)]


def gsm8k_data_files(data_dir: Path) -> dict[str, str]:
    """{split: path} of a GSM8K-format directory, checked to exist and to have question/answer columns."""
    files = {}
    for split in GSM8K_SPLITS:
        path = Path(data_dir) / f"{split}.jsonl"
        first = None
        try:
            with path.open(encoding="utf-8") as f:
                for number, line in enumerate(f, 1):  # every line: a broken one fails here, not inside datasets
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError as e:
                        raise QuantError(f"{path}:{number}: not a JSON object ({e})") from None
                    if not isinstance(record, dict):
                        raise QuantError(f"{path}:{number}: not a JSON object")
                    first = record if first is None else first
        except FileNotFoundError:
            raise QuantError(f"{path}: not found (a GSM8K-format directory needs train.jsonl and test.jsonl)")
        except (OSError, UnicodeDecodeError) as e:
            raise QuantError(f"{path}: not a UTF-8 JSON-lines file ({e})")
        if first is None:
            raise QuantError(f"{path}: no records")
        missing = [c for c in GSM8K_COLUMNS if c not in first]
        if missing:
            raise QuantError(f"{path}: first record lacks the column(s) {', '.join(missing)}")
        files[split] = str(path.resolve())
    return files


def gpqa_data_file(csv_path: Path) -> str:
    """The GPQA-Diamond CSV path, checked for the columns the task reads."""
    path = Path(csv_path)
    try:
        with path.open(newline="") as f:
            header = next(csv.reader(f), [])
    except OSError as e:
        raise QuantError(f"{path}: cannot read the GPQA CSV ({e.strerror or e})")
    missing = [c for c in GPQA_COLUMNS if c not in header]
    if missing:
        raise QuantError(f"{path}: GPQA CSV lacks the column(s) {', '.join(missing)}")
    return str(path.resolve())


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


class _TaggedLoader(yaml.SafeLoader):
    """Reads lm-eval YAML whose `!function` tags name modules beside it: the tag's text is kept."""


_TaggedLoader.add_constructor("!function", lambda loader, node: f"!function {loader.construct_scalar(node)}")


def _stock_filters(path: Path) -> list[dict]:
    """The filter_list of an lm-eval task YAML, following `include:` as lm-eval does."""
    config = yaml.load(path.read_text(), Loader=_TaggedLoader) or {}
    if "filter_list" in config:
        return config["filter_list"]
    if config.get("include"):
        return _stock_filters(path.parent / config["include"])
    return []


def _without_reasoning(filters: list[dict]) -> list[dict]:
    """Each filter pipeline with `strip_reasoning` as its first step."""
    step = {"function": "custom", "filter_fn": f"!function {REASONING_UTILS_MODULE}.strip_reasoning"}
    return [{**f, "filter": [step] + list(f.get("filter") or [])} for f in filters]


def _boxed_config() -> dict:
    """gsm8k_boxed over lm-eval's gsm8k.yaml: the zero-shot boxed prompt, math_verify scoring."""
    tag = f"!function {REASONING_UTILS_MODULE}"
    return {
        "doc_to_text": BOXED_PROMPT + "\n\n{{question}}",
        "num_fewshot": 0,
        "generation_kwargs": {"until": [], "do_sample": False, "temperature": 0.0},
        "filter_list": [{"name": "math-verify", "filter": [
            {"function": "custom", "filter_fn": f"{tag}.strip_reasoning"},
            {"function": "custom", "filter_fn": f"{tag}.boxed_answers"},
            {"function": "take_first"}]}],
        "process_results": f"{tag}.process_boxed",
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    }


def write_task_files(task_dir: Path, specs: list[TaskSpec], *, gsm8k_dir: Path | None, toy_dir: Path | None,
                     gpqa_csv: Path | None, datasets_cache: Path, thinking: str | None = None) -> Path:
    """Write one YAML per task (plus the GPQA process_docs shim and the reasoning filters) into `task_dir`; returns
    `task_dir`. With `thinking` set, every task's filters first cut the reasoning out (chat tasks always do)."""
    import lm_eval

    lm_eval_dir = Path(lm_eval.__file__).resolve().parent
    task_dir.mkdir(parents=True, exist_ok=True)
    for spec in specs:
        config = {
            "include": str(lm_eval_dir / spec.include),
            "task": spec.lm_eval_task,
            "tag": [],  # otherwise the task inherits a group tag such as math_word_problems
            "dataset_name": None,
        }
        if spec.name == "gsm8k_boxed":
            config.update(_boxed_config())
        elif thinking is not None:
            config["filter_list"] = _without_reasoning(_stock_filters(lm_eval_dir / spec.include))
        if spec.data == "gsm8k-jsonl":
            data_dir = toy_dir if spec.name == "toy_arith" else gsm8k_dir
            config["dataset_path"] = "json"
            files = gsm8k_data_files(data_dir)
        else:
            if gpqa_csv is None:
                raise QuantError(f"--tasks {spec.name} needs --gpqa-csv (the GPQA-Diamond CSV)")
            config["dataset_path"] = "csv"
            files = {"train": gpqa_data_file(gpqa_csv)}  # the stock templates evaluate the train split
            config["process_docs"] = PROCESS_DOCS_TAG
        config["dataset_kwargs"] = {"data_files": files, "cache_dir": str(datasets_cache)}
        text = yaml.safe_dump(config, sort_keys=False, width=1000)
        # `!function` is a YAML tag, not a string: unquote it after dumping.
        text = re.sub(r"'(!function [\w.]+)'", r"\1", text)
        (task_dir / f"{spec.lm_eval_task}.yaml").write_text(text)
    if any(spec.data == "gpqa-csv" for spec in specs):
        (task_dir / f"{GPQA_UTILS_MODULE}.py").write_text(
            '"""Generated by evals.arms.tasks: GPQA process_docs with a per-question seeded answer shuffle."""\n'
            "from evals.arms.tasks import gpqa_process_docs as process_docs  # noqa: F401\n"
        )
    (task_dir / f"{REASONING_UTILS_MODULE}.py").write_text(
        '"""Generated by evals.arms.tasks: the reasoning-model filters and the math_verify scoring."""\n'
        "from evals.arms.tasks import boxed_answers, process_boxed, strip_reasoning  # noqa: F401\n"
    )
    return task_dir
