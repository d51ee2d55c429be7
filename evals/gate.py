"""CI gates as files: vLLM's GSM8K accuracy config, read and written, so a release's own CI can carry the gate.

vLLM gates a model with one YAML per model (`tests/evals/gsm8k/configs/*.yaml`, read by
`tests/evals/gsm8k/test_gsm8k_correctness.py`): `model_name`, `accuracy_threshold`, `tolerance` (default 0.08 in
that test: `eval_config.get("tolerance", 0.08)`), `num_questions`, `num_fewshot`, and `min_acceptance_length` for
models with a draft (e.g. `DeepSeek-V4.1-Flash-NVFP4-DSpark-TP4.yaml`); `server_args`, `env` and
`startup_max_wait_seconds` start vLLM's own server and are carried, not used, here. The test passes when
`accuracy >= accuracy_threshold - tolerance`; the acceptance gate when the mean acceptance length is at least
`min_acceptance_length`.

A gate file is read strictly, before any work (QuantError, exit 2, one line naming the file and the key): a key
given twice (PyYAML would keep the last one silently), a key this format does not have, a value of the wrong type
and a value no gate can mean (an accuracy outside [0, 1]; an acceptance length below 1, the token every
verification round accepts, or above 1 + MAX_DRAFT_TOKENS; a question count below 1; a negative few-shot count or
wait) are each refused.

`quant eval --gate FILE` applies it to the candidate arm (a gate miss makes the verdict `fail`, exit 1) after
checking that the run asks what the gate was set for (its task, question count and few-shot count);
`quant eval --write-gate FILE` writes one from this run's baseline arm.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from evals.statistics.results import EvalReport
from quant.errors import QuantError
from quant.files import write_atomic

DEFAULT_TOLERANCE = 0.08  # vLLM's test_gsm8k_correctness.py
DEFAULT_GATE_TASK = "gsm8k"  # vLLM's configs gate GSM8K: a gate file without our `task:` key means it
GATE_KEYS = {
    "model_name": str, "accuracy_threshold": float, "tolerance": float, "min_acceptance_length": float,
    "num_questions": int, "num_fewshot": int, "server_args": str, "env": dict, "startup_max_wait_seconds": int,
    "task": str,  # ours: the task the gate is on (vLLM's configs are GSM8K, the default)
}
REQUIRED = ("accuracy_threshold",)
MAX_DRAFT_TOKENS = 64  # speculative tokens per round no engine is configured beyond: a longer acceptance is a typo
# The values a gate can mean, per key: (low, high, what it is); None where that side is open.
RANGES = {
    "accuracy_threshold": (0, 1, "an accuracy fraction"),
    "tolerance": (0, 1, "an accuracy fraction"),
    "min_acceptance_length": (1, 1 + MAX_DRAFT_TOKENS, "a mean accepted length in tokens per verification round, "
                              "the verified token included, so at least 1"),
    "num_questions": (1, None, "a number of questions"),
    "num_fewshot": (0, None, "a number of few-shot examples"),
    "startup_max_wait_seconds": (0, None, "a number of seconds"),
}


class DuplicateKey(Exception):
    def __init__(self, key, first: int, again: int):
        super().__init__(key)
        self.key, self.first, self.again = key, first, again


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping key given twice (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise DuplicateKey(key, seen[key], line)
                    seen[key] = line
                except TypeError:  # an unhashable key: SafeLoader's own error follows
                    continue
        return super().construct_mapping(node, deep=deep)


@dataclass(frozen=True)
class Gate:
    accuracy_threshold: float
    tolerance: float = DEFAULT_TOLERANCE
    min_acceptance_length: float | None = None
    num_questions: int | None = None
    num_fewshot: int | None = None
    model_name: str | None = None
    task: str = DEFAULT_GATE_TASK
    carried: dict = field(default_factory=dict)  # server_args, env, startup_max_wait_seconds: vLLM's, kept as is


def read_gate(path: Path) -> Gate:
    """The gate in `path`; QuantError naming the file and key for anything it cannot use."""
    try:
        data = yaml.load(Path(path).read_text(), Loader=_StrictLoader)
    except DuplicateKey as e:
        raise QuantError(f"--gate {path}: {e.key}: given twice (lines {e.first} and {e.again}); YAML would keep the "
                         f"last one silently: keep the one meant") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise QuantError(f"--gate {path}: cannot read it ({' '.join(str(e).split())[:200]})") from None
    if not isinstance(data, dict):
        raise QuantError(f"--gate {path}: not a mapping of gate settings (accuracy_threshold, tolerance, ...)")
    for key, value in data.items():
        if key not in GATE_KEYS:
            close = difflib.get_close_matches(str(key), GATE_KEYS, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f" (known: {', '.join(GATE_KEYS)})"
            raise QuantError(f"--gate {path}: {key}: unknown key{hint}")
        want = GATE_KEYS[key]
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) if want is float else \
            isinstance(value, want) and not isinstance(value, bool)
        if not ok or (want is float and not math.isfinite(value)):
            raise QuantError(f"--gate {path}: {key}: {value!r} is not a {want.__name__}")
    for key in REQUIRED:
        if key not in data:
            raise QuantError(f"--gate {path}: {key} is missing (the accuracy the gated model must reach)")
    for key, (low, high, what) in RANGES.items():
        if key in data and ((low is not None and data[key] < low) or (high is not None and data[key] > high)):
            where = f"outside [{low}, {high}]" if high is not None else f"below {low}"
            raise QuantError(f"--gate {path}: {key}: {data[key]} is {where} ({what})")
    carried = {k: data[k] for k in ("server_args", "env", "startup_max_wait_seconds") if k in data}
    return Gate(float(data["accuracy_threshold"]), float(data.get("tolerance", DEFAULT_TOLERANCE)),
                float(data["min_acceptance_length"]) if "min_acceptance_length" in data else None,
                data.get("num_questions"), data.get("num_fewshot"), data.get("model_name"),
                data.get("task", DEFAULT_GATE_TASK), carried)


def check_run(gate: Gate, path: Path, tasks: list, limit: int | None, mtp: bool) -> None:
    """Refuse, before any work, a run that does not ask what the gate was set for."""
    spec = next((s for s in tasks if s.name == gate.task), None)
    if spec is None:
        raise QuantError(f"--gate {path}: gates {gate.task}, which --tasks does not run")
    questions = spec.size if limit is None or (spec.size is not None and limit >= spec.size) else limit
    if gate.num_questions is not None and gate.num_questions != questions:
        raise QuantError(f"--gate {path}: num_questions {gate.num_questions}, but this run asks {questions} "
                         f"({gate.task}); pass --limit {gate.num_questions}")
    if gate.num_fewshot is not None and gate.num_fewshot != spec.fewshot:
        raise QuantError(f"--gate {path}: num_fewshot {gate.num_fewshot}, but {gate.task} here is "
                         f"{spec.fewshot}-shot")
    if gate.min_acceptance_length is not None and not mtp:
        raise QuantError(f"--gate {path}: min_acceptance_length needs the MTP measurement (drop --no-mtp)")


def apply_gate(gate: Gate, report: EvalReport) -> dict:
    """The gate's checks on the candidate arm of `report`: each with what was measured and what it needed."""
    row = report.primary_row(gate.task)
    accuracy = row.comparison.candidate_accuracy
    needed = gate.accuracy_threshold - gate.tolerance
    checks = [{"check": "accuracy", "measured": accuracy, "required": needed,
               "passed": accuracy >= needed - 1e-12,
               "rule": f"accuracy >= accuracy_threshold {gate.accuracy_threshold:g} - tolerance {gate.tolerance:g}"}]
    if gate.min_acceptance_length is not None:
        length = row.acceptance.candidate_length if row.acceptance else None
        measured = length is not None and math.isfinite(length)
        checks.append({"check": "acceptance length", "measured": length if measured else None,
                       "required": gate.min_acceptance_length,
                       "passed": bool(measured and length >= gate.min_acceptance_length),
                       "rule": f"mean acceptance length >= min_acceptance_length {gate.min_acceptance_length:g}"
                               + ("" if measured else " (not measured: the candidate has no draft)")})
    return {"task": gate.task, "model_name": gate.model_name, "checks": checks,
            "passed": all(c["passed"] for c in checks)}


def gate_from_baseline(report: EvalReport, spec, margin_points: float, mtp_margin_points: float,
                       model_name: str | None) -> dict:
    """A gate file's contents from this run's baseline arm: its accuracy as the threshold with the run's margin as
    the tolerance, and (where it has a draft) its acceptance length less the MTP margin as the minimum."""
    task = spec.name
    row = report.primary_row(task)
    if row is None:
        raise QuantError(f"--write-gate: this run has no {task} result to set a gate from")
    gate = {"model_name": model_name or report.candidate.get("name") or "MODEL",
            "accuracy_threshold": round(row.comparison.baseline_accuracy, 4),
            "tolerance": round(margin_points / 100, 4), "num_questions": row.comparison.n_questions,
            "num_fewshot": spec.fewshot}
    length = row.acceptance.baseline_length if row.acceptance else None
    if length is not None and math.isfinite(length):
        # never below 1 (read_gate refuses it): every round accepts at least the verified token
        gate["min_acceptance_length"] = max(1.0, round(length * (1 - mtp_margin_points / 100), 3))
    if task != DEFAULT_GATE_TASK:
        gate["task"] = task
    return {k: v for k, v in gate.items() if v is not None}


def write_gate(path: Path, gate: dict) -> None:
    header = ("# A CI gate in vLLM's GSM8K eval config format (tests/evals/gsm8k/configs), written by\n"
              "# `quant eval --write-gate` from a baseline run; `quant eval --gate` applies it.\n")
    write_atomic(Path(path), header + yaml.safe_dump(gate, sort_keys=False))
