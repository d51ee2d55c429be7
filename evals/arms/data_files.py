"""A data source's local files, checked before lm-eval reads them, and how lm-eval reads each format: the
`dataset_path` builder and the `data_files` splits the generated task YAML names (evals/tasks/data_sources.py says
which source has which format)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from evals.tasks.data_sources import DataSource
from quant.errors import QuantError

GSM8K_COLUMNS = ("question", "answer")
GSM8K_SPLITS = ("train", "test")  # test is evaluated, train is the few-shot pool
GPQA_COLUMNS = ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")
DATASET_PATH = {"gsm8k-jsonl": "json", "gpqa-csv": "csv"}  # the `datasets` builder lm-eval loads each with


def data_files(source: DataSource, path: Path) -> dict[str, str]:
    """{split: absolute path} of `source`'s local copy at `path`, checked."""
    if source.format == "gsm8k-jsonl":
        return gsm8k_data_files(path)
    return {"train": gpqa_data_file(path)}  # lm-eval's GPQA templates evaluate the train split


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
            raise QuantError(f"{path}: not found (a GSM8K-format directory needs train.jsonl and test.jsonl)") from None
        except (OSError, UnicodeDecodeError) as e:
            raise QuantError(f"{path}: not a UTF-8 JSON-lines file ({e})") from None
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
        raise QuantError(f"{path}: cannot read the GPQA CSV ({e.strerror or e})") from None
    missing = [c for c in GPQA_COLUMNS if c not in header]
    if missing:
        raise QuantError(f"{path}: GPQA CSV lacks the column(s) {', '.join(missing)}")
    return str(path.resolve())
