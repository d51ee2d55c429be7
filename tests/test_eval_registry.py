"""The eval task registry (evals/tasks): every record loads and is read strictly, --help and the README list what
it holds, and a task added as data alone (one record in a copy of the task directory) reaches the registry,
`quant eval --help`, the request's checks and the lm-eval task file written for it."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import evals.arms.tasks as task_functions
from evals.arms.lm_eval_run import go_offline
from evals.arms.tasks import FUNCTION_MODULES, write_task_files
from evals.request import EvalRequest, check_chat, check_inputs
from evals.tasks.data_sources import EVAL_DATA_DIR
from evals.tasks.lm_eval_yaml import FUNCTION_TAG, TASK_CONFIG_KEYS, read_yaml
from evals.tasks.registry import RECORDS_DIR, TASKS_DIR_ENV, budgets_help, parse_tasks, registry, tasks_help
from quant.errors import QuantError

REPO = Path(__file__).resolve().parent.parent

# A new task, as data only: GSM8K's lm-eval task asked zero-shot with another prompt, on the packaged toy data.
FAKE_TASK = """\
include: tasks/gsm8k/gsm8k.yaml
task: fake_arith_local
doc_to_text: "Compute: {{question}}\\nResult:"
num_fewshot: 0
quant:
  label: fake arithmetic 0-shot
  data: toy_arith
  filters: [flexible-extract]
  max_gen_toks: 48
  thinking_max_gen_toks: 96
  floor: 0.05
  size: 200
"""


def quant(*args, tasks_dir: Path | None = None):
    env = {**os.environ, "COLUMNS": "200", "TERM": "dumb"}
    env.pop(TASKS_DIR_ENV, None)
    if tasks_dir is not None:
        env[TASKS_DIR_ENV] = str(tasks_dir)
    return subprocess.run([sys.executable, "-m", "quant.cli", *args], capture_output=True, text=True, timeout=300,
                          env=env)


def flat(text: str) -> str:
    """Help text with its wrapping undone (click wraps at the terminal's width)."""
    return " ".join(text.split())


@pytest.fixture
def tasks_copy(tmp_path, monkeypatch):
    """A copy of the packaged task directory, which the registry reads instead (QUANT_EVAL_TASKS)."""
    directory = tmp_path / "records"
    shutil.copytree(RECORDS_DIR, directory)
    monkeypatch.setenv(TASKS_DIR_ENV, str(directory))
    return directory


def test_every_record_loads_and_is_named_by_its_file():
    tasks = registry()
    assert list(tasks) == sorted(p.stem for p in RECORDS_DIR.glob("*.yaml"))
    assert {"gsm8k", "gpqa_diamond", "gsm8k_boxed", "toy_arith"} <= set(tasks)
    for name, task in tasks.items():
        assert task.name == name and task.filters and 0 <= task.floor < 1 and task.default_max_gen_toks >= 1


def test_the_overlay_keys_are_lm_evals_own():
    from lm_eval.api.task import TaskConfig

    assert set(TASK_CONFIG_KEYS) <= {f.name for f in dataclasses.fields(TaskConfig)}


def test_every_function_a_record_names_is_written_beside_it():
    """A `!function module.name` tag resolves in the directory the task files are written to."""
    for path in RECORDS_DIR.glob("*.yaml"):
        for module, name in re.findall(rf"{FUNCTION_TAG} (\w+)\.(\w+)", path.read_text()):
            assert module in FUNCTION_MODULES, (path.name, module)
            exported = FUNCTION_MODULES[module][1]
            source = next(e.split(" as ")[0] for e in exported.split(", ") if e.split(" as ")[-1] == name)
            assert callable(getattr(task_functions, source)), (path.name, name)


def test_the_help_lists_are_the_registry():
    import typer

    from quant.cli import app

    params = {p.name: p for p in typer.main.get_command(app).commands["eval"].params}
    tasks = registry()
    assert params["tasks"].help == "Comma-separated: " + ", ".join(f"{n} ({t.label})" for n, t in tasks.items())
    assert params["max_gen_toks"].help == f"Max generated tokens (default per task: {budgets_help()})"
    assert "gsm8k_boxed 2048 (16384 with --thinking on)" in budgets_help()
    assert params["tasks"].default == EvalRequest.tasks and params["limit"].default == EvalRequest.limit


def test_the_readme_lists_the_registry():
    readme = (REPO / "README.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", readme, flags=re.M)
    assert dict(rows) == {name: task.label for name, task in registry().items()}


@pytest.mark.parametrize("edit,message", [
    (lambda t: t + "dataset_path: json\n", "dataset_path: set by the run from the data source"),
    (lambda t: t + "doc_to_txt: x\n", "doc_to_txt: unknown key (did you mean 'doc_to_text'?)"),
    (lambda t: t.replace("  floor: 0.05", "  flor: 0.05"), "quant.flor: unknown key (did you mean 'floor'?)"),
    (lambda t: t.replace("  floor: 0.05\n", ""), "quant.floor is missing"),
    (lambda t: t.replace("max_gen_toks: 48", "max_gen_toks: many"), "quant.max_gen_toks: 'many' is not of type int"),
    (lambda t: t.replace("data: toy_arith", "data: toy_arithm"), "quant.data: 'toy_arithm' is not a data source"),
    (lambda t: t.replace("[flexible-extract]", "[flexible]"), "quant.filters: 'flexible' is not a filter"),
    (lambda t: t.replace("tasks/gsm8k/gsm8k.yaml", "tasks/gsm8k/nope.yaml"), "include: tasks/gsm8k/nope.yaml is "
                                                                            "not a task file"),
    (lambda t: t + "num_fewshot: 3\n", "num_fewshot: given twice (lines 4 and 13)"),
    (lambda t: t.replace("quant:\n", "quant: [\n"), "cannot read it as a task record"),
    (lambda t: t.replace("task: fake_arith_local", "task: gsm8k_local"), "task: gsm8k_local is also the task of"),
])
def test_a_bad_record_is_one_line_naming_the_file_and_key(tasks_copy, edit, message):
    (tasks_copy / "fake_arith.yaml").write_text(edit(FAKE_TASK))
    with pytest.raises(QuantError, match=re.escape(message)) as err:
        registry()
    assert "\n" not in str(err.value) and "fake_arith.yaml" in str(err.value)


def test_a_bad_record_on_the_command_line_is_one_error_line(tmp_path):
    broken = tmp_path / "records"
    shutil.copytree(RECORDS_DIR, broken)
    (broken / "gsm8k.yaml").write_text((RECORDS_DIR / "gsm8k.yaml").read_text().replace("floor:", "flor:"))
    result = quant("eval", "--candidate", "http://127.0.0.1:9/v1", "--baseline", "http://127.0.0.1:10/v1",
                   "--out", str(tmp_path / "out"), tasks_dir=broken)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: {broken / 'gsm8k.yaml'}: quant.flor: unknown key (did you mean 'floor'?) (known: label, data, "
        f"filters, max_gen_toks, floor, thinking_max_gen_toks, sampled, chat, size)"]
    assert quant("eval", "--help", tasks_dir=broken).returncode == 0  # --help (and every other command) still works


def test_a_task_added_as_data_only_is_picked_up(tasks_copy, tmp_path):
    (tasks_copy / "fake_arith.yaml").write_text(FAKE_TASK)

    task = registry()["fake_arith"]
    assert (task.label, task.data, task.fewshot, task.filters) == ("fake arithmetic 0-shot", "toy_arith", 0,
                                                                   ("flexible-extract",))
    assert "fake_arith (fake arithmetic 0-shot)" in tasks_help()

    help_text = flat(quant("eval", "--help", tasks_dir=tasks_copy).stdout)
    assert "fake_arith (fake arithmetic 0-shot)" in help_text
    assert "fake_arith 48 (96 with --thinking on)" in help_text

    request = EvalRequest(candidate=str(tmp_path / "a"), baseline=str(tmp_path / "b"), tasks="gsm8k,fake_arith")
    specs = parse_tasks(request.tasks)
    assert [s.name for s in specs] == ["gsm8k", "fake_arith"]
    check_chat(request, specs)
    check_inputs(EvalRequest(candidate=str(tmp_path / "a"), baseline=str(tmp_path / "b"), tasks="fake_arith"),
                 parse_tasks("fake_arith"))  # its data, the packaged toy set, is checked
    with pytest.raises(QuantError, match="did you mean 'fake_arith'.*fake_arith"):
        parse_tasks("fake_arth")

    from lm_eval.tasks import TaskManager

    task_dir = write_task_files(tmp_path / "tasks", specs[1:], data={"toy_arith": EVAL_DATA_DIR / "toy_arith"},
                                datasets_cache=tmp_path / "cache")
    assert read_yaml(task_dir / "fake_arith_local.yaml")["doc_to_text"] == "Compute: {{question}}\nResult:"
    go_offline(tmp_path / "cache")
    loaded = TaskManager(include_path=str(task_dir), include_defaults=False).load(["fake_arith_local"])
    lm_task = loaded["tasks"]["fake_arith_local"]
    doc = next(iter(lm_task.test_docs()))
    assert lm_task.doc_to_text(doc) == f"Compute: {doc['question']}\nResult:"
    assert lm_task.config.num_fewshot == 0
