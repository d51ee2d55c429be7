"""Offline lm-eval task files: local GSM8K-format data, a GPQA CSV with a per-question seeded answer order."""

import csv
import json
import random
from pathlib import Path

import pytest

from evals.arms.lm_eval_run import go_offline
from evals.arms.data_files import GPQA_COLUMNS
from evals.arms.tasks import gpqa_choice_order, write_task_files
from evals.tasks.registry import parse_tasks, registry
from quant.errors import QuantError

GPQA_EXTRA_COLUMNS = ("Record ID", "High-level domain")


def write_gpqa_csv(path: Path, n: int = 6, reverse: bool = False) -> Path:
    """A synthetic CSV with GPQA-Diamond's columns (the real set is gated and never enters the repo)."""
    rows = [{"Question": f"Synthetic question {i}: which option is labelled right?",
             "Correct Answer": f"right {i}", "Incorrect Answer 1": f"wrong-a {i}",
             "Incorrect Answer 2": f"wrong-b {i}", "Incorrect Answer 3": f"wrong-c {i}",
             "Record ID": f"rec{i}", "High-level domain": "Toy"} for i in range(n)]
    if reverse:
        rows.reverse()
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*GPQA_EXTRA_COLUMNS[:1], *GPQA_COLUMNS, GPQA_EXTRA_COLUMNS[1]])
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_gsm8k_dir(path: Path, n: int = 8) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        with open(path / f"{split}.jsonl", "w") as f:
            for i in range(n):
                f.write(json.dumps({"question": f"{split} {i} plus 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"})
                        + "\n")
    return path


def load_docs(tmp: Path, task: str, data: Path, thinking: str | None = None):
    from lm_eval.tasks import TaskManager

    spec = registry()[task]
    task_dir = write_task_files(tmp / "tasks", [spec], data={spec.data: data}, datasets_cache=tmp / "cache",
                                thinking=thinking)
    go_offline(tmp / "cache")
    loaded = TaskManager(include_path=str(task_dir), include_defaults=False).load([spec.lm_eval_task])
    return loaded["tasks"][spec.lm_eval_task]


def test_unknown_or_empty_task_is_an_error():
    with pytest.raises(QuantError, match="unknown task 'mmlu'"):
        parse_tasks("gsm8k,mmlu")
    with pytest.raises(QuantError, match="empty"):
        parse_tasks(" , ")
    assert [s.name for s in parse_tasks("gpqa_diamond,gsm8k,gsm8k")] == ["gpqa_diamond", "gsm8k"]


def test_missing_data_is_named(tmp_path):
    with pytest.raises(QuantError, match=r"nowhere/train\.jsonl: not found"):
        write_task_files(tmp_path / "t", parse_tasks("gsm8k"), data={"gsm8k": tmp_path / "nowhere"},
                         datasets_cache=tmp_path / "c")
    with pytest.raises(QuantError, match="needs --gpqa-csv"):
        write_task_files(tmp_path / "t", parse_tasks("gpqa_diamond"), data={}, datasets_cache=tmp_path / "c")
    bad = tmp_path / "bad.csv"
    bad.write_text("Question,Correct Answer\nq,a\n")
    with pytest.raises(QuantError, match="bad.csv: GPQA CSV lacks the column.*Incorrect Answer 1"):
        write_task_files(tmp_path / "t", parse_tasks("gpqa_diamond"), data={"gpqa_diamond": bad},
                         datasets_cache=tmp_path / "c")
    data = write_gsm8k_dir(tmp_path / "g")
    (data / "test.jsonl").write_text(json.dumps({"q": 1}) + "\n")
    with pytest.raises(QuantError, match="test.jsonl: first record lacks the column"):
        write_task_files(tmp_path / "t", parse_tasks("gsm8k"), data={"gsm8k": data}, datasets_cache=tmp_path / "c")


def test_gsm8k_format_task_uses_lm_evals_prompt_offline(tmp_path):
    task = load_docs(tmp_path, "gsm8k", write_gsm8k_dir(tmp_path / "g"))
    docs = list(task.test_docs())
    assert len(docs) == 8 and docs[0]["question"] == "test 0 plus 1?"
    assert task.doc_to_text(docs[0]) == "Question: test 0 plus 1?\nAnswer:"
    assert task.config.num_fewshot == 5 and task.config.fewshot_split == "train"
    assert [f["name"] for f in task.config.filter_list] == ["strict-match", "flexible-extract"]


def gpqa_orders(tmp_path: Path, reverse: bool) -> dict[str, tuple[list[str], str]]:
    tmp_path.mkdir()
    random.seed(12345 if reverse else 0)  # the stock process_docs would follow this global state
    task = load_docs(tmp_path, "gpqa_diamond", write_gpqa_csv(tmp_path / "gpqa.csv", reverse=reverse))
    return {d["Question"]: (d["choices"], d["answer"]) for d in task.validation_docs()}


def test_gpqa_answer_order_is_seeded_by_the_question(tmp_path):
    first = gpqa_orders(tmp_path / "a", reverse=False)
    second = gpqa_orders(tmp_path / "b", reverse=True)
    assert first == second, "the answer order must not depend on row order, global RNG or the datasets cache"
    letters = set()
    for question, (choices, answer) in first.items():
        i = question.split(":")[0].split()[-1]
        originals = [f"wrong-a {i}", f"wrong-b {i}", f"wrong-c {i}", f"right {i}"]
        assert choices == [originals[k] for k in gpqa_choice_order(question)]
        assert choices["ABCD".index(answer[1])] == f"right {i}"
        letters.add(answer)
    assert len(letters) > 1, "six questions should not all get the same correct letter"
