"""Evaluation data from the Hugging Face hub, for runs that are not given local files.

lm-eval's own tasks read `openai/gsm8k` (config `main`) and the gated `Idavidrein/gpqa` (config
`gpqa_diamond`); with no data flags `quant eval` loads the same datasets through `datasets` (cached where
`datasets` caches, using the user's Hugging Face token for the gated one) and writes them as the local files the
generated task YAMLs read, so the prompts and scoring are identical on both paths. `--data-dir` / `--gpqa-csv`
serve offline and air-gapped machines; with the hub switched off and no local data, one line says what to pass.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

from quant.errors import QuantError

GSM8K_HUB = ("openai/gsm8k", "main")
GPQA_HUB = ("Idavidrein/gpqa", "gpqa_diamond")
OFFLINE_FLAGS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def hub_offline() -> str | None:
    """The environment flag that switches the hub off, if one is set."""
    for flag in OFFLINE_FLAGS:
        if os.environ.get(flag, "").strip().lower() in ("1", "true", "yes", "on"):
            return flag
    return None


def _load(repo: str, config: str, what: str, flag_hint: str):
    flag = hub_offline()
    if flag:
        raise QuantError(f"{what}: {flag} is set and no local copy was given; pass {flag_hint} (or unset {flag} "
                         f"to load {repo} [{config}] from the hub)")
    import datasets

    try:
        return datasets.load_dataset(repo, config)
    except Exception as e:  # connection, authentication (gated), missing config: one line, the user's fix
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise QuantError(f"{what}: cannot load {repo} [{config}] from the hub ({first}); pass {flag_hint} to use "
                         "a local copy") from None


def fetch_gsm8k(dest: Path) -> Path:
    """openai/gsm8k [main] as dest/{train,test}.jsonl (question/answer); returns dest."""
    data = _load(*GSM8K_HUB, "GSM8K", "--data-dir DIR (train.jsonl and test.jsonl with question/answer)")
    dest.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        with open(dest / f"{split}.jsonl", "w") as f:
            for row in data[split]:
                f.write(json.dumps({"question": row["question"], "answer": row["answer"]}) + "\n")
    return dest


def fetch_gpqa_diamond(dest: Path, columns: tuple[str, ...]) -> Path:
    """Idavidrein/gpqa [gpqa_diamond] (gated: needs an accepted licence and a token) as a CSV with `columns`."""
    data = _load(*GPQA_HUB, "GPQA-Diamond", "--gpqa-csv FILE (the gpqa_diamond CSV)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for row in data["train"]:
            writer.writerow([row[c] for c in columns])
    return dest
