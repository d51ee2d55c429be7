"""Eval data from the hub: the exact dataset requests (at the `datasets.load_dataset` boundary, fed from the real
GSM8K files beside the checkout so nothing is downloaded), the files the tasks then read, and the one-line
errors offline or when the hub refuses."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import datasets
import pytest

from evals.arms import hub_data
from evals.compare import EvalRequest
from evals.run_arms import eval_data
from evals.arms.data_files import GPQA_COLUMNS, gpqa_data_file, gsm8k_data_files
from evals.tasks.registry import parse_tasks
from quant.errors import QuantError

SHARED_GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


@pytest.fixture
def online(monkeypatch):
    for flag in hub_data.OFFLINE_FLAGS:
        monkeypatch.delenv(flag, raising=False)


def local_gsm8k(n: int = 20) -> datasets.DatasetDict:
    if not SHARED_GSM8K.is_dir():
        pytest.skip(f"{SHARED_GSM8K} not present")
    splits = {}
    for split in ("train", "test"):
        rows = [json.loads(line) for line in (SHARED_GSM8K / f"{split}.jsonl").open()][:n]
        splits[split] = datasets.Dataset.from_list(rows)
    return datasets.DatasetDict(splits)


def test_gsm8k_comes_from_openai_gsm8k_main(online, monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append((a, k)) or local_gsm8k())
    data = eval_data(EvalRequest(candidate="x", tasks="gsm8k"), parse_tasks("gsm8k"), tmp_path)
    assert calls == [(("openai/gsm8k", "main"), {})]
    assert list(data) == ["gsm8k"]
    gsm8k_dir = data["gsm8k"]
    files = gsm8k_data_files(gsm8k_dir)  # the same check the task writer applies to a user's --data-dir
    first = json.loads(Path(files["test"]).open().readline())
    assert first == json.loads((SHARED_GSM8K / "test.jsonl").open().readline())


def test_gpqa_comes_from_the_gated_dataset(online, monkeypatch, tmp_path):
    row = {c: f"{c} text" for c in GPQA_COLUMNS} | {"Subdomain": "x"}
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append(a) or
                        datasets.DatasetDict({"train": datasets.Dataset.from_list([row, row])}))
    gpqa = eval_data(EvalRequest(candidate="x", tasks="gpqa_diamond"), parse_tasks("gpqa_diamond"),
                     tmp_path)["gpqa_diamond"]
    assert calls == [("Idavidrein/gpqa", "gpqa_diamond")]
    assert gpqa_data_file(gpqa)
    assert list(csv.reader(gpqa.open()))[1] == [row[c] for c in GPQA_COLUMNS]


def test_local_data_is_used_without_asking_the_hub(online, monkeypatch, tmp_path):
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("hub asked"))
    request = EvalRequest(candidate="x", tasks="gsm8k", data_dir=SHARED_GSM8K)
    assert eval_data(request, parse_tasks("gsm8k"), tmp_path) == {"gsm8k": SHARED_GSM8K}


@pytest.mark.parametrize("task,flag", [("gsm8k", "--data-dir"), ("gpqa_diamond", "--gpqa-csv")])
def test_offline_without_local_data_says_what_to_pass(online, monkeypatch, tmp_path, task, flag):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("hub asked"))
    with pytest.raises(QuantError, match=f"HF_DATASETS_OFFLINE is set .* pass {flag}"):
        eval_data(EvalRequest(candidate="x", tasks=task), parse_tasks(task), tmp_path)


def test_a_hub_refusal_is_one_line(online, monkeypatch, tmp_path):
    def refuse(*a, **k):
        raise ConnectionError("Dataset 'Idavidrein/gpqa' is a gated dataset on the Hub.\nVisit the page.")

    monkeypatch.setattr(datasets, "load_dataset", refuse)
    with pytest.raises(QuantError) as err:
        eval_data(EvalRequest(candidate="x", tasks="gpqa_diamond"), parse_tasks("gpqa_diamond"), tmp_path)
    assert "\n" not in str(err.value) and "gated dataset" in str(err.value) and "--gpqa-csv" in str(err.value)
