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


GSM8K_HINT = "--data-dir DIR (train.jsonl and test.jsonl with question/answer)"
GPQA_HINT = "--gpqa-csv FILE (the gpqa_diamond CSV)"


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub's host answers a TCP connection within `timeout` (datasets would otherwise retry for
    half a minute before saying it is offline)."""
    import socket
    from urllib.parse import urlparse

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


def fetch_gsm8k(dest: Path) -> Path:
    """openai/gsm8k [main] as dest/{train,test}.jsonl (question/answer); returns dest."""
    data = _load(*GSM8K_HUB, "GSM8K", GSM8K_HINT)
    dest.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        with open(dest / f"{split}.jsonl", "w") as f:
            for row in data[split]:
                f.write(json.dumps({"question": row["question"], "answer": row["answer"]}) + "\n")
    return dest


def fetch_gpqa_diamond(dest: Path, columns: tuple[str, ...]) -> Path:
    """Idavidrein/gpqa [gpqa_diamond] (gated: needs an accepted licence and a token) as a CSV with `columns`."""
    data = _load(*GPQA_HUB, "GPQA-Diamond", GPQA_HINT)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for row in data["train"]:
            writer.writerow([row[c] for c in columns])
    return dest
