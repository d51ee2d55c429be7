"""Evaluation data from the Hugging Face hub, for runs that are not given local files.

lm-eval's own tasks read `openai/gsm8k` (config `main`) and the gated `Idavidrein/gpqa` (config
`gpqa_diamond`); with no data flags `quant eval` loads the same datasets through `datasets` (cached where
`datasets` caches, using the user's Hugging Face token for the gated one) and writes them as the local files the
generated task YAMLs read, so the prompts and scoring are identical on both paths. Which data set, from which
repo, and the flag of a local copy are each data source's (evals/tasks/data_sources.py). `--data-dir` /
`--gpqa-csv` serve offline and air-gapped machines; with the hub switched off and no local data, one line says
what to pass.
"""

from __future__ import annotations

import csv
import json
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from evals.arms.data_files import GPQA_COLUMNS, GSM8K_COLUMNS, GSM8K_SPLITS
from evals.tasks.data_sources import DataSource
from quant.errors import QuantError

OFFLINE_FLAGS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def hub_offline() -> str | None:
    """The environment flag that switches the hub off, if one is set."""
    for flag in OFFLINE_FLAGS:
        if os.environ.get(flag, "").strip().lower() in ("1", "true", "yes", "on"):
            return flag
    return None


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub's host answers a TCP connection within `timeout` (datasets would otherwise retry for
    half a minute before saying it is offline)."""

    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                      timeout=timeout):
            return True
    except OSError:
        return False


def require_data(needed: dict[str, str]) -> None:
    """`needed`: {what: flag hint} of the datasets no local copy was given for. With the hub switched off or
    unreachable, one error names every one of them (before any work, not one per round)."""
    if not needed:
        return
    flag = hub_offline()
    why = f"{flag} is set" if flag else None if hub_reachable() else "the hub is unreachable from this machine"
    if why:
        parts = "; ".join(f"{what}: pass {hint}" for what, hint in needed.items())
        raise QuantError(f"{why} and no local copy was given for {', '.join(needed)} ({parts})")


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


def fetch(source: DataSource, dest: Path) -> Path:
    """`source` from the hub, written under `dest` in its format: a GSM8K-format directory dest/NAME, or the CSV
    dest/NAME.csv; returns that path."""
    if source.hub is None:
        raise QuantError(f"{source.what}: no hub copy to load ({source.hint})")
    repo, config = source.hub
    data = _load(repo, config, source.what, source.hint)
    if source.format == "gsm8k-jsonl":
        return _write_jsonl(data, dest / source.name)
    return _write_csv(data, dest / f"{source.name}.csv")


def _write_jsonl(data, dest: Path) -> Path:
    """{train,test}.jsonl with the question/answer columns."""
    dest.mkdir(parents=True, exist_ok=True)
    for split in GSM8K_SPLITS:
        with open(dest / f"{split}.jsonl", "w") as f:
            for row in data[split]:
                f.write(json.dumps({c: row[c] for c in GSM8K_COLUMNS}) + "\n")
    return dest


def _write_csv(data, dest: Path) -> Path:
    """The train split (gated GPQA's only one) as a CSV with GPQA's columns."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(GPQA_COLUMNS)
        for row in data["train"]:
            writer.writerow([row[c] for c in GPQA_COLUMNS])
    return dest
