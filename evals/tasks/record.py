"""One eval task's record (records/<name>.yaml) read and checked into an EvalTask.

A record is an lm-eval task overlay in lm-eval's own `include:` style (its top-level keys are lm-eval TaskConfig
keys, over the lm-eval task YAML it includes) plus one mapping of our keys, `quant:`, that lm-eval never sees.
`include:` names the lm-eval YAML relative to the installed lm_eval package; the file written for lm-eval at run
time (evals/arms/tasks.py) names it by absolute path and adds the data source's files. The record's file name is
the task's name on the command line (`--tasks`).

Anything a record gets wrong is one QuantError naming the file and the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import yaml

from evals.tasks.data_sources import DATA_SOURCES
from evals.tasks.lm_eval_yaml import TASK_CONFIG_KEYS, DuplicateKey, lm_eval_dir, merged_config, read_yaml
from quant.errors import QuantError, did_you_mean

# The run writes these from the data source (`quant: data:`): a record setting them would read other data.
DATA_KEYS = ("dataset_path", "dataset_name", "dataset_kwargs", "tag")
OVERLAY_KEYS = tuple(k for k in TASK_CONFIG_KEYS if k not in DATA_KEYS + ("task",))
NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # a `--tasks` list item: no commas or spaces

# Our keys, under `quant:`: (type, required, what it is). `int` never accepts a bool; `float` accepts an int.
OUR_KEYS: dict[str, tuple[type, bool, str]] = {
    "label": (str, True, "the row label in the report"),
    "data": (str, True, "the data source: " + ", ".join(DATA_SOURCES)),
    "filters": (list, True, "the lm-eval filters reported, primary first"),
    "max_gen_toks": (int, True, "the default generation budget in tokens"),
    "floor": (float, True, "the accuracy at or below which an arm's setup is broken (chance level, or a minimum)"),
    "thinking_max_gen_toks": (int, False, "the default budget with --thinking on"),
    "sampled": (bool, False, "several seeds at --temperature (true) or one greedy run (false, the default)"),
    "chat": (bool, False, "asked as chat messages through the model's chat template (default false)"),
    "size": (int, False, "questions in the evaluated split (what --limit can reach)"),
}


@dataclass(frozen=True)
class EvalTask:
    """One evaluation as the user names it (`--tasks`), and how it runs."""

    name: str                   # the record's file name: what --tasks lists
    label: str                  # row label in the report
    lm_eval_task: str           # name of the generated lm-eval task (the record's `task:`)
    include: str                # lm-eval YAML it extends, relative to the lm_eval package
    data: str                   # its data source (evals/tasks/data_sources.py)
    filters: tuple[str, ...]    # lm-eval filters reported, primary first
    sampled: bool               # True: several seeds at temperature 1.0; False: one greedy run
    default_max_gen_toks: int
    # At or below this accuracy an arm's setup is broken, not its weights (evals/statistics/evidence.py).
    floor: float
    size: int | None = None     # questions in the test set (what --limit can reach)
    fewshot: int = 0            # few-shot examples per prompt (the overlay's num_fewshot, else the included task's)
    chat: bool = False          # asked as chat messages (the model's chat template; a server's chat endpoint)
    thinking_max_gen_toks: int | None = None  # the default budget with --thinking on (None: default_max_gen_toks)
    overlay: Mapping = field(default_factory=dict, hash=False)  # the lm-eval keys the record sets over `include`

    @property
    def primary_filter(self) -> str:
        return self.filters[0]

    @property
    def budget(self) -> str:
        """`2048 tokens (16384 with --thinking on)`: its default generation budget, for --help."""
        thinking = f" ({self.thinking_max_gen_toks} with --thinking on)" if self.thinking_max_gen_toks else ""
        return f"{self.default_max_gen_toks}{thinking}"


def read_record(path: Path) -> EvalTask:
    """The task recorded in `path`; QuantError naming the file and the key for anything it cannot use."""
    path = Path(path)
    name = path.stem
    if not NAME.match(name):
        raise QuantError(f"{path}: the file name {name!r} is the task's name on the command line: letters, digits, "
                         f"'_', '.' and '-' only")
    try:
        config = read_yaml(path)
    except DuplicateKey as e:
        raise QuantError(f"{path}: {e}; YAML would keep the last one silently: keep the one meant") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ValueError) as e:
        raise QuantError(f"{path}: cannot read it as a task record ({' '.join(str(e).split())[:200]})") from None
    for key in ("include", "task", "quant"):
        if key not in config:
            raise QuantError(f"{path}: {key} is missing (a record is an lm-eval overlay: include, task, and our "
                             f"keys under quant)")
    for key in config:
        if key in DATA_KEYS:
            raise QuantError(f"{path}: {key}: set by the run from the data source (quant: data:), not by a record")
        if key not in OVERLAY_KEYS + ("include", "task", "quant"):
            raise QuantError(f"{path}: {key}: unknown key{did_you_mean(key, OVERLAY_KEYS + ('quant',))}; a record's "
                             f"keys are lm-eval TaskConfig keys and quant")
    for key in ("include", "task"):
        if not isinstance(config[key], str) or not config[key]:
            raise QuantError(f"{path}: {key}: {config[key]!r} is not a name")
    ours = _our_keys(path, config["quant"])
    included = lm_eval_dir() / config["include"]
    if not included.is_file():
        raise QuantError(f"{path}: include: {config['include']} is not a task file of the installed lm-eval "
                         f"({included})")
    overlay = {k: v for k, v in config.items() if k not in ("include", "task", "quant")}
    task_config = {**merged_config(included), **overlay}
    known_filters = [f.get("name") for f in task_config.get("filter_list") or [] if isinstance(f, dict)]
    for name_ in ours["filters"]:
        if name_ not in known_filters:
            raise QuantError(f"{path}: quant.filters: {name_!r} is not a filter of this task (its filter_list: "
                             f"{', '.join(map(str, known_filters)) or 'none'})")
    return EvalTask(
        name=name, label=ours["label"], lm_eval_task=config["task"], include=config["include"], data=ours["data"],
        filters=tuple(ours["filters"]), sampled=ours.get("sampled", False),
        default_max_gen_toks=ours["max_gen_toks"], floor=float(ours["floor"]), size=ours.get("size"),
        fewshot=int(task_config.get("num_fewshot") or 0), chat=ours.get("chat", False),
        thinking_max_gen_toks=ours.get("thinking_max_gen_toks"), overlay=overlay,
    )


def _our_keys(path: Path, ours) -> dict:
    """The `quant:` mapping, every key known, of its type and in range."""
    if not isinstance(ours, dict):
        raise QuantError(f"{path}: quant: not a mapping of our keys ({', '.join(OUR_KEYS)})")
    for key, value in ours.items():
        if key not in OUR_KEYS:
            raise QuantError(f"{path}: quant.{key}: unknown key{did_you_mean(key, OUR_KEYS)} (known: "
                             f"{', '.join(OUR_KEYS)})")
        want, _, what = OUR_KEYS[key]
        ok = isinstance(value, (int, float)) if want is float else isinstance(value, want)
        if not ok or (want is not bool and isinstance(value, bool)):
            raise QuantError(f"{path}: quant.{key}: {value!r} is not of type {want.__name__} ({what})")
    for key, (_, required, what) in OUR_KEYS.items():
        if required and key not in ours:
            raise QuantError(f"{path}: quant.{key} is missing ({what})")
    if ours["data"] not in DATA_SOURCES:
        raise QuantError(f"{path}: quant.data: {ours['data']!r} is not a data source"
                         f"{did_you_mean(ours['data'], DATA_SOURCES)} (choose from {', '.join(DATA_SOURCES)})")
    if not ours["filters"] or not all(isinstance(f, str) for f in ours["filters"]):
        raise QuantError(f"{path}: quant.filters: a list of lm-eval filter names, primary first")
    if not 0 <= ours["floor"] < 1:
        raise QuantError(f"{path}: quant.floor: {ours['floor']} is outside [0, 1) (an accuracy fraction)")
    for key in ("max_gen_toks", "thinking_max_gen_toks", "size"):
        if key in ours and ours[key] < 1:
            raise QuantError(f"{path}: quant.{key}: {ours[key]} must be at least 1")
    return ours
