"""Executing a plan shard by shard: load → quantize → write atomically → record.

Each finished output shard gets a progress record (`.quant-progress/<shard>.json`) holding the plan digest,
the output's sha256 and the per-tensor records. A re-run skips a shard whose record matches the plan and whose
bytes still hash to the record, so a killed run resumes to the same bytes as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quant.checkpoint import Checkpoint, safetensors_dtype
from quant.errors import QuantError
from quant.numerics import fp8
from quant.pipeline.plan import Plan, ShardJob, Source, TensorJob
from quant.pipeline.schemes import SCHEMES

PROGRESS_DIR = ".quant-progress"


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_atomic(path: Path, data: bytes | str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    mode = "wb" if isinstance(data, bytes) else "w"
    with open(tmp, mode) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


ERROR_SAMPLE_ROWS = 128  # rows on which a large weight's error is measured; smaller weights: every row


def error_windows(rows: int, align: int) -> list[tuple[int, int]]:
    """Row windows for the error measurement: all rows of a small weight, else windows spread evenly over the
    weight (aligned to the scheme's row tiles) that add up to ERROR_SAMPLE_ROWS rows. Dequantizing is several
    times slower than quantizing, so measuring every row of a [2048, 6144] expert would dominate the run."""
    if rows <= ERROR_SAMPLE_ROWS:
        return [(0, rows)]
    window = max(8, align)
    starts = list(range(0, rows, window))
    count = max(1, min(len(starts), ERROR_SAMPLE_ROWS // window))
    return [(starts[i * len(starts) // count], min(rows, starts[i * len(starts) // count] + window))
            for i in range(count)]


def error_stats(original: torch.Tensor, parts: dict[str, torch.Tensor], scheme) -> dict:
    """Relative MSE and SQNR (dB) of a quantized weight over `error_windows` rows: fp32 dot products per
    window, summed in Python floats (float64) across windows."""
    noise = signal = 0.0
    windows = error_windows(original.shape[0], scheme.row_align)
    for r0, r1 in windows:
        x = original[r0:r1].float().reshape(-1)
        d = x - scheme.dequantize(scheme.rows(parts, r0, r1)).reshape(-1)
        noise += float(torch.dot(d, d))
        signal += float(torch.dot(x, x))
    rel = noise / signal if signal else 0.0
    sqnr = math.inf if noise == 0 else 10 * math.log10(signal / noise) if signal else -math.inf
    return {"rel_mse": rel, "sqnr_db": round(sqnr, 4) if math.isfinite(sqnr) else None,
            "error_rows": sum(r1 - r0 for r0, r1 in windows)}


class SourceReader:
    """Open shard handles for one shard job; slices of fused experts are read without loading the rest."""

    def __init__(self, ckpt: Checkpoint, device: str):
        self.ckpt, self.device, self.handles = ckpt, device, {}

    def handle(self, file: str):
        if file not in self.handles:
            path = self.ckpt.shard_path(file)
            try:
                self.handles[file] = safe_open(str(path), framework="pt")
            except Exception as e:
                raise QuantError(f"{path}: cannot open ({str(e).splitlines()[0]})") from None
        return self.handles[file]

    def raw(self, file: str, name: str, expert: int | None = None, rows=None) -> torch.Tensor:
        try:
            h = self.handle(file)
            t = h.get_tensor(name) if expert is None else h.get_slice(name)[expert, rows[0]:rows[1]]
        except QuantError:
            raise
        except Exception as e:
            raise QuantError(f"{self.ckpt.shard_path(file)}: cannot read tensor {name} "
                             f"({str(e).splitlines()[0]})") from None
        return t.to(self.device)

    def load(self, src: Source) -> torch.Tensor:
        t = self.raw(src.file, src.name, src.expert, src.rows)
        if src.scale_inv:
            t = fp8.dequantize_fp8_block(t, self.raw(src.scale_inv_file, src.scale_inv), dtype=torch.float32)
        return t

    def close(self) -> None:
        self.handles.clear()


def _tensor_record(t: torch.Tensor) -> dict:
    return {"dtype": safetensors_dtype(t.dtype), "shape": list(t.shape)}


def run_job(job: TensorJob, reader: SourceReader, scale_mode: str,
            timing: Counter) -> tuple[dict[str, torch.Tensor], dict]:
    t0 = time.perf_counter()
    src = reader.load(job.source)
    t1 = time.perf_counter()
    timing["read_s"] += t1 - t0
    record = {"action": job.action, "source": job.source.describe(), "role": job.role,
              "source_dtype": reader.ckpt.tensors[job.source.name].dtype,
              "source_shape": list(src.shape)}
    where = f"{reader.ckpt.shard_path(job.source.file)}: tensor {job.source.describe()}"
    if job.action == "copy":
        out = {job.output: src.contiguous()}
    elif job.action == "dequantize":
        out = {job.output: src.to(torch.bfloat16).contiguous()}
    else:
        scheme = SCHEMES[job.scheme]
        if not src.is_floating_point():
            raise QuantError(f"{where} has dtype {src.dtype}; only floating-point weights can be quantized")
        try:
            parts = scheme.quantize(src, scale_mode)
        except QuantError as e:
            raise QuantError(f"{where}: {e}") from None
        timing["quantize_s"] += time.perf_counter() - t1
        t2 = time.perf_counter()
        record.update(scheme=scheme.name, **error_stats(src, parts, scheme))
        timing["error_stats_s"] += time.perf_counter() - t2
        out = {f"{job.output}.{suffix}": t.contiguous() for suffix, t in parts.items()}
    record["outputs"] = {name: _tensor_record(t) for name, t in out.items()}
    return {name: t.cpu() for name, t in out.items()}, record


@dataclass
class ShardResult:
    file: str
    sha256: str
    bytes: int
    source_file: str
    source_sha256: str
    tensors: dict  # output tensor name -> {dtype, shape}
    records: dict  # job output -> record


def progress_path(out: Path, shard: ShardJob) -> Path:
    return out / PROGRESS_DIR / (shard.file + ".json")


def completed(out: Path, shard: ShardJob, digest: str) -> ShardResult | None:
    """The recorded result of a shard finished by an earlier run of the same plan, if its bytes still match."""
    rec_path, shard_path = progress_path(out, shard), out / shard.file
    if not (rec_path.is_file() and shard_path.is_file()):
        return None
    try:
        rec = json.loads(rec_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if rec.get("plan_digest") != digest or shard_path.stat().st_size != rec["result"]["bytes"]:
        return None
    if sha256_file(shard_path) != rec["result"]["sha256"]:
        return None
    return ShardResult(**rec["result"])


def run_shard(plan: Plan, digest: str, shard: ShardJob, ckpt: Checkpoint, out: Path, device: str,
              timing: Counter | None = None) -> ShardResult:
    """Quantize one shard; `timing` accumulates seconds spent reading, quantizing, writing and hashing."""
    timing = Counter() if timing is None else timing
    reader = SourceReader(ckpt, device)
    tensors: dict[str, torch.Tensor] = {}
    records: dict[str, dict] = {}
    # hashlib releases the GIL: the source is hashed on the other core while this one quantizes.
    with ThreadPoolExecutor(max_workers=1) as hasher:
        source_hash = hasher.submit(sha256_file, ckpt.shard_path(shard.source_file))
        try:
            for job in shard.jobs:
                produced, record = run_job(job, reader, plan.scale_mode, timing)
                tensors.update(produced)
                records[job.output] = record
        finally:
            reader.close()
        t0 = time.perf_counter()
        source_sha = source_hash.result()
    t1 = time.perf_counter()
    target = out / shard.file
    tmp = target.with_name(target.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, target)
    t2 = time.perf_counter()
    out_sha = sha256_file(target)
    timing["hash_s"] += (t1 - t0) + (time.perf_counter() - t2)
    timing["write_s"] += t2 - t1
    result = ShardResult(file=shard.file, sha256=out_sha, bytes=target.stat().st_size,
                         source_file=shard.source_file, source_sha256=source_sha,
                         tensors={n: _tensor_record(t) for n, t in sorted(tensors.items())}, records=records)
    (out / PROGRESS_DIR).mkdir(exist_ok=True)
    write_atomic(progress_path(out, shard),
                 json.dumps({"plan_digest": digest, "result": result.__dict__}, sort_keys=True))
    return result
