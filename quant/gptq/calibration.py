"""Calibration text for GPTQ: where it comes from, and how it becomes token windows.

`--calib-data` is one of
  - a local file: .txt (the whole file is one text), .jsonl / .json (a list of records; each record's "text" field,
    or else its string fields joined by newlines), .parquet (its "text" column);
  - a Hugging Face dataset, `ID[:CONFIG[:SPLIT]]` (split "train" by default), read through `datasets`; its "text"
    column, or the string columns of each row joined. The default is wikitext-2's training split, the set GPTQ
    and most of its successors calibrate on (`DEFAULT_DATA`).

The texts are joined by blank lines and tokenized with the checkpoint's own tokenizer; `samples` windows of
`seq_len` tokens are cut at seeded random offsets (as GPTQ's reference code samples C4/wikitext), so every window
is a full sequence and no padding is needed.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

from quant.errors import QuantError

DEFAULT_DATA = "Salesforce/wikitext:wikitext-2-raw-v1:train"
LOCAL_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")  # a --calib-data naming a local file
MAX_CORPUS_CHARS = 64 << 20  # enough text for thousands of 2048-token windows; more is not read


@dataclass(frozen=True)
class CalibrationSettings:
    data: str = DEFAULT_DATA
    samples: int = 128
    seq_len: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        self.check()

    def to_dict(self) -> dict:
        return {"data": self.data, "samples": self.samples, "seq_len": self.seq_len, "seed": self.seed}

    def check(self) -> None:
        """Raise QuantError naming the flag for a value no calibration can run with (checked when built)."""
        for flag, value, least in (("--calib-samples", self.samples, 1), ("--calib-seq-len", self.seq_len, 2)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise QuantError(f"{flag} {value}: must be a whole number of at least {least}")
        if not isinstance(self.data, str) or not self.data.strip():
            raise QuantError(f"--calib-data {self.data!r}: must name a local file or a hub dataset")

    def require_local_file(self) -> None:
        """A `data` naming a local file that is not there: QuantError now, for a command that has work to do
        before it reads the text (a library caller may name a file relative to a directory it changes to)."""
        path = Path(self.data)
        if path.suffix.lower() in LOCAL_SUFFIXES and not path.is_file():
            raise QuantError(f"{path}: calibration file not found")


def _record_text(record, where: str) -> str:
    if isinstance(record, str):
        return record
    if not isinstance(record, dict):
        raise QuantError(f"{where}: a calibration record must be an object or a string, got {type(record).__name__}")
    if isinstance(record.get("text"), str):
        return record["text"]
    parts = [v for v in record.values() if isinstance(v, str)]
    if not parts:
        raise QuantError(f"{where}: a calibration record has no \"text\" field and no string fields")
    return "\n".join(parts)


def _local_texts(path: Path) -> list[str]:
    suffix = path.suffix.lower()
    try:
        if suffix == ".txt":
            return [path.read_text(errors="replace")[:MAX_CORPUS_CHARS]]
        if suffix == ".jsonl":
            texts, size = [], 0
            with path.open(errors="replace") as f:
                for i, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        texts.append(_record_text(json.loads(line), f"{path}:{i}"))
                    except json.JSONDecodeError as e:
                        raise QuantError(f"{path}:{i}: not JSON ({e.msg})") from None
                    size += len(texts[-1])
                    if size > MAX_CORPUS_CHARS:
                        break
            return texts
        if suffix == ".json":
            data = json.loads(path.read_text(errors="replace"))
            if not isinstance(data, list):
                raise QuantError(f"{path}: expected a JSON list of records")
            return [_record_text(r, str(path)) for r in data]
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(path)
            if "text" not in table.column_names:
                raise QuantError(f"{path}: no \"text\" column (columns: {', '.join(table.column_names)})")
            return [t for t in table.column("text").to_pylist() if isinstance(t, str)]
    except OSError as e:
        raise QuantError(f"{path}: cannot read calibration data ({e.strerror or e})") from None
    except ValueError as e:
        raise QuantError(f"{path}: cannot parse calibration data ({str(e).splitlines()[0]})") from None
    raise QuantError(f"{path}: calibration files must be .txt, .jsonl, .json or .parquet")


def _hub_texts(spec: str) -> list[str]:
    name, config, split = (spec.split(":") + [None, None])[:3]
    if os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") in ("1", "true"):
        raise QuantError(f"--calib-data {spec}: the Hugging Face hub is offline; pass a local .txt/.jsonl file")
    try:
        import datasets

        rows = datasets.load_dataset(name, config or None, split=split or "train")
    except Exception as e:  # network and dataset errors come in many types; the first line says which
        raise QuantError(f"--calib-data {spec}: cannot load the dataset ({str(e).splitlines()[0][:160]})") from None
    texts, size = [], 0
    for row in rows:
        text = row["text"] if isinstance(row.get("text"), str) else "\n".join(
            v for v in row.values() if isinstance(v, str))
        if text.strip():
            texts.append(text)
            size += len(text)
            if size > MAX_CORPUS_CHARS:
                break
    return texts


def load_texts(data: str) -> list[str]:
    path = Path(data)
    if path.exists() or path.suffix.lower() in LOCAL_SUFFIXES:
        if not path.is_file():
            raise QuantError(f"{path}: calibration file not found")
        return _local_texts(path)
    return _hub_texts(data)


def data_identity(data: str) -> str:
    """What the manifest records of the data: a local file's sha256, else the dataset spec."""
    path = Path(data)
    if path.is_file():
        return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    return "hub:" + data


def token_windows(texts: list[str], tokenizer, samples: int, seq_len: int, seed: int, where: str):
    """LongTensor [samples, seq_len] of token ids: windows of the joined, tokenized texts at seeded offsets."""
    import torch

    tokenizer.model_max_length = 1 << 62  # one long text cut into windows here, not a model input
    ids = tokenizer("\n\n".join(texts), add_special_tokens=False)["input_ids"]
    if len(ids) < seq_len:
        raise QuantError(f"{where}: the calibration text has {len(ids)} tokens, fewer than --calib-seq-len "
                         f"{seq_len}")
    rng = random.Random(seed)
    starts = [rng.randrange(0, len(ids) - seq_len + 1) for _ in range(samples)]
    return torch.tensor([ids[s:s + seq_len] for s in starts], dtype=torch.long)


def calibration_tokens(settings: CalibrationSettings, checkpoint: Path):
    """The calibration windows for `checkpoint`, tokenized with its tokenizer."""
    from transformers import AutoTokenizer

    settings.check()
    try:
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    except Exception as e:
        raise QuantError(f"{checkpoint}: cannot load the tokenizer GPTQ calibrates with "
                         f"({str(e).splitlines()[0][:160]})") from None
    texts = load_texts(settings.data)
    if not any(t.strip() for t in texts):
        raise QuantError(f"--calib-data {settings.data}: no text")
    return token_windows(texts, tokenizer, settings.samples, settings.seq_len, settings.seed,
                         f"--calib-data {settings.data}")
