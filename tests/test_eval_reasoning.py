"""Reasoning-model tasks (issue #33 item 3): GSM8K zero-shot chat with `\\boxed{}` answers scored by math_verify
(SGLang's nightly), GPQA-Diamond CoT, with the reasoning kept out of answer extraction. Here the generated task
files go through lm-eval's own task loading, filter pipeline and process_results on given responses; the runs
against the project's server with a chat template that thinks are tests/test_eval_thinking.py."""

from pathlib import Path

import pytest

from evals.arms.lm_eval_run import RunSettings, template_kwargs
from evals.arms.tasks import last_boxed, split_reasoning
from evals.compare import EvalRequest, evaluate
from evals.tasks.registry import registry
from quant.errors import QuantError
from test_eval_tasks import load_docs, write_gpqa_csv, write_gsm8k_dir

SHARED_GSM8K = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "gsm8k"


def score(task, doc, response: str, name: str | None = None) -> tuple[str, float]:
    """(extracted, score) of one response through the task's own filters and process_results (lm-eval's
    Task.apply_filters over an Instance, as simple_evaluate runs them)."""
    from lm_eval.api.instance import Instance

    instance = Instance(request_type="generate_until", doc=doc, arguments=("", {}), idx=0,
                        metadata=(task.config.task, 0, 1))
    instance.resps = [response]
    task._instances = [instance]
    task.apply_filters()
    name = name or task.config.filter_list[0]["name"]
    extracted = instance.filtered_resps[name]
    return extracted, task.process_results(doc, [extracted])["exact_match"]


def test_gsm8k_boxed_is_sglangs_prompt_scored_by_math_verify(tmp_path):
    data = SHARED_GSM8K if (SHARED_GSM8K / "test.jsonl").exists() else write_gsm8k_dir(tmp_path / "g")
    task = load_docs(tmp_path, "gsm8k_boxed", data)
    doc = next(iter(task.test_docs()))
    gold = doc["answer"].split("####")[-1].strip().replace(",", "")
    assert task.doc_to_text(doc) == ("Solve the following math problem. Make sure to put the answer (and only "
                                     "answer) inside \\boxed{}.\n\n" + doc["question"])
    assert task.config.num_fewshot == 0 and [f["name"] for f in task.config.filter_list] == ["math-verify"]
    wrong = str(int(gold) + 1)
    cases = {
        f"So the total is \\boxed{{{gold}}}.": (gold, 1.0),
        f"\\boxed{{{wrong}}} at first, then \\boxed{{{gold}.0}}": (f"{gold}.0", 1.0),  # the last box, equal as numbers
        f"\\boxed{{\\frac{{{2 * int(gold)}}}{{2}}}}": (f"\\frac{{{2 * int(gold)}}}{{2}}", 1.0),
        f"The answer is {gold}.": ("", 0.0),  # no box: nothing to score
        f"\\boxed{{{wrong}}}": (wrong, 0.0),
        # the reasoning's box is never the answer: cut at </think>, whether the template or the model opened it
        f"<think>maybe \\boxed{{{gold}}}</think>\nIt is \\boxed{{{wrong}}}": (wrong, 0.0),
        f"<think>surely \\boxed{{{gold}}}</think>\nNo box here.": ("", 0.0),
        f"I think \\boxed{{{wrong}}}.</think>\n\\boxed{{{gold}}}": (gold, 1.0),
        f"<think>still thinking about \\boxed{{{gold}}}": ("", 0.0),  # cut off inside its reasoning
    }
    for response, expected in cases.items():
        assert score(task, doc, response) == expected, response


def test_gpqa_with_thinking_extracts_from_the_answer_only(tmp_path):
    csv_path = write_gpqa_csv(tmp_path / "gpqa.csv", n=3)
    plain = load_docs(tmp_path / "plain", "gpqa_diamond", csv_path)
    thinking = load_docs(tmp_path / "thinking", "gpqa_diamond", csv_path, thinking="on")
    doc = next(iter(thinking.validation_docs()))
    right = doc["answer"]
    wrong = next(f"({c})" for c in "ABCD" if f"({c})" != right)
    response = f"<think>Not {right}; is it {wrong}? Yes, {wrong}.</think>\nThe answer is {right}."
    for name in ("flexible-extract", "strict-match"):
        assert any(f["name"] == name for f in thinking.config.filter_list)
    for name in ("flexible-extract", "strict-match"):
        assert score(thinking, doc, response, name) == (right, 1.0), name
    assert score(thinking, doc, f"<think>It is {right}.</think>\nNo idea.", "flexible-extract")[1] == 0.0
    # without --thinking the stock filters read the reasoning too: flexible-extract's last letter is the wrong one
    assert score(plain, doc, f"Not {right}; {wrong}</think>", "flexible-extract") == (wrong, 0.0)
    assert [f["name"] for f in plain.config.filter_list] == [f["name"] for f in thinking.config.filter_list]


def test_split_and_box_edge_cases():
    assert split_reasoning("plain answer") == ("", "plain answer")
    assert split_reasoning("all reasoning, never closed", opened=True) == ("all reasoning, never closed", "")
    assert split_reasoning("<think>a</think>b</think> c") == ("a</think>b", "c")
    assert last_boxed("\\boxed{a{b}c} and \\boxed{unclosed") == ""
    assert last_boxed("\\boxed{a{b}c} then \\fbox{7}") == "7"
    assert last_boxed("\\boxed {12}") == "12"


def test_thinking_budgets_and_template_switch():
    spec = registry()["gsm8k_boxed"]
    assert RunSettings(limit=1, max_gen_toks=None, seeds=1).gen_kwargs(spec)["max_gen_toks"] == 2048
    assert RunSettings(limit=1, max_gen_toks=None, seeds=1, thinking="on").gen_kwargs(spec)["max_gen_toks"] == 16384
    assert RunSettings(limit=1, max_gen_toks=99, seeds=1, thinking="on").gen_kwargs(spec)["max_gen_toks"] == 99
    gpqa = registry()["gpqa_diamond"]
    assert RunSettings(limit=1, max_gen_toks=None, seeds=1, thinking="on").gen_kwargs(gpqa)["max_gen_toks"] == 32768
    assert template_kwargs("off") == {"enable_thinking": False, "thinking": False}
    assert template_kwargs(None) == {}


def test_thinking_needs_a_chat_template_and_is_refused_before_any_work(tmp_path):
    fixture = Path(__file__).resolve().parent.parent / "evals" / "data" / "toy_arith" / "model"
    for kw, message in (({"thinking": "maybe"}, "--thinking 'maybe': choose from on, off"),
                        ({"thinking": "on", "tasks": "toy_arith"}, "toy_arith is asked as a plain completion"),
                        ({"tasks": "gsm8k_boxed"},
                         "gsm8k_boxed is a chat task: servers are asked it with --endpoint chat")):
        request = {"candidate": str(fixture), "baseline": "http://127.0.0.1:9/v1", "out": tmp_path / "out",
                   "tasks": "gsm8k_boxed", **kw}
        with pytest.raises(QuantError, match=message):
            evaluate(EvalRequest(**request), log=lambda m: None)
    assert not (tmp_path / "out").exists()
