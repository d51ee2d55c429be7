"""lm-eval task YAML as lm-eval reads it, without importing lm-eval (`quant eval --help` reads the task records).

A task file may `include:` others; lm-eval merges the included configs first and lets the including file's keys
win (`load_yaml` in lm_eval/tasks/_yaml_loader.py, lm-eval 0.4.x), resolving a relative `include:` against the
including file. `!function module.name` tags name a Python module beside the YAML; they are kept here as the tag's
text, so a config read here can be written back for lm-eval unchanged.
"""

from __future__ import annotations

import copy
import importlib.util
from functools import cache
from pathlib import Path

import yaml

FUNCTION_TAG = "!function"

# The keys of lm-eval's TaskConfig (lm_eval/api/task.py, 0.4.x): what a task record's overlay may set.
TASK_CONFIG_KEYS = (
    "task", "task_alias", "tag", "custom_dataset", "dataset_path", "dataset_name", "dataset_kwargs",
    "training_split", "validation_split", "test_split", "fewshot_split", "process_docs", "doc_to_text",
    "doc_to_target", "doc_to_image", "doc_to_audio", "unsafe_code", "doc_to_choice", "process_results", "use_prompt",
    "description", "target_delimiter", "fewshot_delimiter", "fewshot_config", "num_fewshot", "metric_list",
    "output_type", "generation_kwargs", "repeats", "filter_list", "should_decontaminate",
    "doc_to_decontamination_query", "gen_prefix", "metadata",
)


class DuplicateKey(ValueError):
    """A mapping key given twice (PyYAML would keep the last one silently)."""

    def __init__(self, key, first: int, again: int):
        super().__init__(f"{key}: given twice (lines {first} and {again})")
        self.key = key


class TaskYamlLoader(yaml.SafeLoader):
    """SafeLoader that keeps `!function` tags as text and refuses a key given twice."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if isinstance(key, (str, int, float, bool)) and key in seen:
                    raise DuplicateKey(key, seen[key], line)
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


TaskYamlLoader.add_constructor(FUNCTION_TAG, lambda loader, node: f"{FUNCTION_TAG} {loader.construct_scalar(node)}")


def lm_eval_dir() -> Path:
    """The installed lm_eval package's directory, found without importing it (seconds of imports)."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("lm_eval is not installed")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def read_yaml(path: Path) -> dict:
    """One task YAML as written (no includes followed)."""
    config = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=TaskYamlLoader)
    if not isinstance(config, dict):
        raise ValueError("not a mapping of task settings")
    return config


def merged_config(path: Path) -> dict:
    """The config lm-eval builds from `path`: its includes merged in order, its own keys winning."""
    return copy.deepcopy(_merged(Path(path).resolve()))


@cache  # lm-eval's own files do not change under a running process; the task records include the same few
def _merged(path: Path) -> dict:
    config = read_yaml(path)
    includes = config.pop("include", None)
    if includes is None:
        return config
    merged: dict = {}
    for include in includes if isinstance(includes, list) else [includes]:
        merged.update(_merged((path.parent / include).resolve()))
    return {**merged, **config}
