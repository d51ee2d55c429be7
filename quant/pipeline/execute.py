"""Executing a plan shard by shard: load → quantize → write atomically → record (see `progress`)."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch
from safetensors.torch import save_file

from quant.checkpoint import Checkpoint, SourceReader, safetensors_dtype
from quant.errors import QuantError
from quant.files import share_like_other_files, sha256_file, write_atomic
from quant.pipeline.output import TMP_DIR
from quant.pipeline.shard_records import ShardResult, progress_path
from quant.planning.plan import Plan, ShardJob, TensorJob
from quant.planning.schemes import SCHEMES
from quant.sources import native

ERROR_SAMPLE_ROWS = 128  # rows on which a large weight's error is measured; smaller weights: every row


def error_rows(rows: int, align: int) -> torch.Tensor:
    """Row indices for the error measurement: every row of a small weight; else ERROR_SAMPLE_ROWS rows spread
    evenly over the weight, in whole windows of `align` rows (a block-FP8 tile row) when the scheme needs them.
    Measuring every row of a [2048, 6144] expert would cost about as much as quantizing it."""
    if rows <= ERROR_SAMPLE_ROWS:
        return torch.arange(rows)
    windows = -(-rows // align)
    count = max(1, min(windows, ERROR_SAMPLE_ROWS // align))
    starts = [(i * windows // count) * align for i in range(count)]
    return torch.cat([torch.arange(r0, min(rows, r0 + align)) for r0 in starts])


def error_stats(original: torch.Tensor, parts: dict[str, torch.Tensor], scheme) -> dict:
    """Relative MSE and SQNR (dB) of a quantized weight over its `error_rows`, the same on every CPU.

    The squared errors are summed in float64 (exact products of float32 values; only the order of the additions
    varies with the vector ISA and the BLAS a CPU picks, by about 1e-13 relative) and recorded to 6 significant
    digits (SQNR to 4 decimals), far coarser than that: a float32 dot product, whose order-dependent rounding moved
    the sixth digit, made the manifests of one export differ between CPUs (issue #48)."""
    index = error_rows(original.shape[0], scheme.row_align).to(original.device)
    rows, row_parts = original.index_select(0, index), scheme.rows(parts, index)
    if scheme.error_sums:
        noise, signal = scheme.error_sums(rows, row_parts)
    else:
        x = rows.reshape(-1).to(torch.float64)
        d = x - scheme.dequantize(row_parts).reshape(-1).to(torch.float64)
        noise, signal = float(torch.dot(d, d)), float(torch.dot(x, x))
    rel = float(f"{noise / signal:.6g}") if signal else 0.0
    sqnr = math.inf if noise == 0 else 10 * math.log10(signal / noise) if signal else -math.inf
    return {"rel_mse": rel, "sqnr_db": round(sqnr, 4) if math.isfinite(sqnr) else None, "error_rows": len(index)}


def _tensor_record(t: torch.Tensor) -> dict:
    return {"dtype": safetensors_dtype(t.dtype), "shape": list(t.shape)}


def run_job(job: TensorJob, reader: SourceReader, scale_mode: str, timing: Counter,
            solved=None) -> tuple[dict[str, torch.Tensor], dict]:
    """One job's output tensors and manifest record. `solved` (a `quant.pipeline.solver.Solution`: GPTQ's) holds
    the weights a solver solved; the others are rounded to nearest."""
    t0 = time.perf_counter()
    if job.action == "passthrough":
        return _passthrough(job, reader, timing)
    is_native = isinstance(job.source, native.NativeSource)
    src = native.read_values(reader, job.source)
    t1 = time.perf_counter()
    timing["read_s"] += t1 - t0
    record = {"action": job.action, "source": job.source.describe(), "role": job.role,
              "source_dtype": reader.ckpt.tensors[job.source.name].dtype,
              "source_shape": list(src.shape)}
    where = f"{reader.ckpt.shard_path(job.source.file)}: tensor {job.source.describe()}"
    if job.action == "copy":
        # A copy of its own: a view would keep the whole source shard mapped (and resident) until written.
        out = {job.output: src.clone(memory_format=torch.contiguous_format)}
    elif job.action == "dequantize":
        out = {job.output: src.to(torch.bfloat16, copy=True).contiguous()}
    else:
        scheme = SCHEMES[job.scheme]
        if not src.is_floating_point():
            raise QuantError(f"{where} has dtype {src.dtype}; only floating-point weights can be quantized")
        parts, method = solved.parts(job) if solved is not None else (None, None)
        if parts is None:
            try:
                parts = scheme.quantize(src, scale_mode)
            except QuantError as e:
                raise QuantError(f"{where}: {e}") from None
        if is_native:
            # the error below is measured against the released (decoded) weight, not against a BF16 original
            record.update(source_encoding=job.source.encoding,
                          **native.loss_account(job.source, src, parts, scheme.name))
        if solved is not None:
            record["method"] = method
        timing["quantize_s"] += time.perf_counter() - t1
        t2 = time.perf_counter()
        record.update(scheme=scheme.name, **error_stats(src, parts, scheme))
        timing["error_stats_s"] += time.perf_counter() - t2
        out = {f"{job.output}.{suffix}": t.contiguous() for suffix, t in parts.items()}
    record["outputs"] = {name: _tensor_record(t) for name, t in out.items()}
    return {name: t.cpu() for name, t in out.items()}, record


def _passthrough(job: TensorJob, reader: SourceReader, timing: Counter) -> tuple[dict[str, torch.Tensor], dict]:
    """A weight into the format it already has (MXFP4 into Quark MXFP4, E8M0-scaled FP8 into Quark MXFP8, UE8M0
    128x128 FP8 into block FP8): its codes and scales bit for bit (quant.sources), nothing decoded or rounded."""
    t0 = time.perf_counter()
    parts = native.passthrough_parts(reader, job.source, job.scheme)
    timing["read_s"] += time.perf_counter() - t0
    out = {f"{job.output}.{suffix}": t for suffix, t in parts.items()}
    record = {"action": job.action, "source": job.source.describe(), "role": job.role,
              "source_dtype": reader.ckpt.tensors[job.source.name].dtype,
              "source_shape": native.logical_shape(reader.ckpt, job.source),
              "source_encoding": job.source.encoding, "scheme": job.scheme, "rel_mse": 0.0, "sqnr_db": None,
              "outputs": {name: _tensor_record(t) for name, t in out.items()}}
    return {name: t.cpu() for name, t in out.items()}, record


def run_shard(plan: Plan, digest: str, shard: ShardJob, ckpt: Checkpoint, out: Path, device: str,
              source_hash: Future, timing: Counter | None = None, defer_write: bool = False, solved=None
              ) -> ShardResult | Callable[[], ShardResult]:
    """Quantize one shard, then write it (`write_shard`). `source_hash` is the source's sha256, computed beside
    it; `timing` accumulates seconds per phase. With `defer_write`, the write is returned as a callable for the
    caller to run (in the thread of its choice) instead of being done here."""
    timing = Counter() if timing is None else timing
    reader = SourceReader(ckpt, device)
    tensors: dict[str, torch.Tensor] = {}
    records: dict[str, dict] = {}
    try:
        for job in shard.jobs:
            produced, record = run_job(job, reader, plan.scale_mode, timing, solved)
            tensors.update(produced)
            records[job.output] = record
    finally:
        reader.close()
    write = functools.partial(write_shard, digest, shard, out, tensors, records, source_hash, timing)
    return write if defer_write else write()


def write_shard(digest: str, shard: ShardJob, out: Path, tensors: dict[str, torch.Tensor], records: dict[str, dict],
                source_hash: Future, timing: Counter) -> ShardResult:
    """Write the shard atomically, hash it, and record it as complete (its progress record).

    save_file streams the tensors into the file; serializing them to one bytes object first (to hash it in memory
    or write it past the page cache) costs as much again in fresh memory."""
    t0 = time.perf_counter()
    target = out / shard.file
    # The temporary lives in the run's own .quant-tmp/, and so does the `.tmpXXXXXX` safetensors writes first:
    # whatever a kill leaves there is ours to delete on resume, and OUT never shows a half-written shard.
    tmp = out / TMP_DIR / target.name
    save_shard(tensors, tmp)
    share_like_other_files(tmp)
    t1 = time.perf_counter()
    out_sha = sha256_file(tmp)
    t2 = time.perf_counter()
    source_sha = source_hash.result()
    timing["hash_wait_s"] += time.perf_counter() - t2
    timing["hash_s"] += t2 - t1
    timing["write_s"] += t1 - t0
    result = ShardResult(file=shard.file, sha256=out_sha, bytes=tmp.stat().st_size,
                         source_file=shard.source_file, source_sha256=source_sha,
                         tensors={n: _tensor_record(t) for n, t in sorted(tensors.items())}, records=records)
    # The progress record before the shard: a shard in OUT always has the record that makes it ours (a kill in
    # between leaves a record without its shard, which the next run redoes).
    write_atomic(progress_path(out, shard),
                 json.dumps({"plan_digest": digest, "result": result.__dict__}, sort_keys=True), out / TMP_DIR)
    os.replace(tmp, target)
    return result


def save_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file, its I/O errors (disk full, read-only, permission) raised as the OSError they are
    (safetensors reports them as its own error type, with the errno in the text)."""
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except OSError:
        raise
    except Exception as e:  # SafetensorError: "Error while serializing: I/O error: ... (os error 28)"
        code = re.search(r"os error (\d+)", str(e))
        if code:
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from None
        raise QuantError(f"{path}: cannot write the shard ({str(e).splitlines()[0]})") from None
