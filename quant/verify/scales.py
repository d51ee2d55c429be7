"""Scale sanity (`quant verify-manifest --scales`): read every scale tensor of a checkpoint, never a weight.

The header preflight cannot see a scale's values, yet the public incidents of MoE exports that load everywhere
and answer wrongly are scale values: experts that calibration (or the weight loading before it) never reached
get an MXFP4 E8M0 scale block of 0x00 (2^-127: the expert's weights dequantize to zero, the expert outputs zero)
or 0xFF (E8M0's NaN: the expert outputs NaN), and FP8 scales of zero, inf or NaN. Every engine loads these.

Detection is pure functions over arrays (`e8m0_issues`, `float_issues`, `e4m3_issues`), the file walking is
`scan_scales`. What counts as a scale: the tensors named `*.weight_scale`, `*.weight_scale_inv`,
`*.weight_scale_2`, `*.input_scale`, `*.output_scale`, `*.{q,k,v}_scale` (and gpt-oss' U8 `*_scales`), and every
F8_E8M0 tensor whatever its name (a sidecar table's `.scale`). U8 scales are E8M0 when the config's
quantization_config declares an MX format (Quark `scale_format:
e8m0` / fp4 dtypes, `quant_method: mxfp4`, ...); float scales (F32/BF16/F16) are FP8/INT scales; F8_E4M3 scales
are NVFP4's block scales.

Severity. One 0x00 scale byte can be legitimate: a 32-element block that is all zeros in the source gets 0x00.
So scattered 0x00 blocks are a warning with their count and fraction; a whole weight of 0x00 (or a whole expert
of a fused tensor, or a contiguous run of whole rows covering half a weight or more: the gate or up half of a
fused gate_up) is an error, as is any 0xFF byte. Float scales: NaN, inf or negative is an error; zero is an
error for a whole weight and for activation scales (the engines divide by them), a warning otherwise.

Findings of one routed expert are grouped: "model.layers.3.mlp.experts.17 (gate_proj, up_proj, down_proj)".

Reading: the scale tensors' byte ranges come from each shard's safetensors header and are read with one
`pread` each, in file order (no torch import, no mapping of the weights; safetensors' numpy framework cannot
represent BF16 or E8M0). For an MXFP4 checkpoint that is about 1/17 of its bytes.
"""

from __future__ import annotations

import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from quant.checkpoint import Checkpoint, open_checkpoint
from quant.safetensors_header import read_header
from quant.verify.report import Finding

# compressed-tensors NVFP4 spells its per-tensor scales `weight_global_scale` / `input_global_scale` (divided by)
WEIGHT_SCALES = ("weight_scale", "weight_scale_inv", "weight_scale_2", "weight_global_scale")
ACTIVATION_SCALES = ("input_scale", "output_scale", "q_scale", "k_scale", "v_scale", "input_global_scale")
SCALE_SUFFIXES = WEIGHT_SCALES + ACTIVATION_SCALES
FLOAT_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}  # BF16 is decoded by hand
E8M0_DTYPES = ("U8", "F8_E8M0")
RULE = "scales: "
# "model.layers.3.mlp.experts.17.gate_proj.weight_scale" -> unit "model.layers.3.mlp.experts.17", part "gate_proj"
_PER_EXPERT = re.compile(r"^(?P<unit>.*\bexperts\.\d+)\.(?P<part>.+)\.[^.]+$")
# fused 3-D expert tensors: "model.layers.3.mlp.experts.gate_up_proj_scales" [E, R, C]
_FUSED_EXPERTS = re.compile(r"^(?P<unit>.*\bexperts)\.(?P<part>[^.]+?)(?:_scales|\.[^.]+)?$")


# ---- what a scale tensor is ------------------------------------------------------------------------------------

def _strings(obj):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield str(k), v
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)


def declares_mx(config: dict) -> bool:
    """Whether the config's quantization_config declares an E8M0-scaled (MX) format anywhere: Quark
    `scale_format: e8m0` or an fp4/fp6/mx dtype, `quant_method: mxfp4`, compressed-tensors `mxfp4-*` formats."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    if not isinstance(qc, dict):
        return False
    for key, value in _strings(qc):
        if not isinstance(value, str):
            continue
        v = value.lower()
        if "e8m0" in v or "mxfp" in v or (key == "quant_method" and v in ("mxfp4", "mxfp8", "mx")):
            return True
        if key == "dtype" and (v.startswith(("fp4", "fp6", "mx"))):
            return True
    return False


def scale_kind(name: str, dtype: str, mx: bool) -> str | None:
    """"e8m0", "float", "e4m3" or None (not a scale tensor, or one this check does not read) for tensor `name`
    of safetensors dtype `dtype`; `mx`: the config declares an MX format (`declares_mx`)."""
    if dtype == "F8_E8M0":  # a dtype only scales have, whatever the name (DeepSeek-V4.1's Engram `.scale` tables)
        return "e8m0"
    last = name.rsplit(".", 1)[-1]
    if last not in SCALE_SUFFIXES and not (last.endswith("_scales") and dtype in E8M0_DTYPES):
        return None
    if dtype == "F8_E8M0" or (dtype == "U8" and mx):
        return "e8m0"
    if dtype in FLOAT_DTYPES or dtype == "BF16":
        return "float"
    if dtype == "F8_E4M3":
        return "e4m3"
    return None


def decode(raw: bytes | memoryview, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """The array of a tensor's raw little-endian bytes: uint8 for U8/F8 dtypes, float32/16/64 for floats."""
    if dtype in FLOAT_DTYPES:
        arr = np.frombuffer(raw, dtype=FLOAT_DTYPES[dtype])
    elif dtype == "BF16":
        arr = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        arr = np.frombuffer(raw, dtype=np.uint8)
    return arr.reshape(shape)


# ---- detection (pure) --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Issue:
    """One problem of one scale tensor (or one expert slice of a fused one), before grouping by expert.
    `counts`: {"bad": elements at fault, "total": elements, ...} added up when issues are grouped."""

    unit: str  # the tensor, or the routed expert ("model.layers.3.mlp.experts.17")
    part: str  # within an expert: "gate_proj"; else the tensor's own name
    rule: str
    severity: str
    counts: dict = field(default_factory=dict, hash=False, compare=False)
    tensor: str = field(default="", compare=False)  # the scale tensor it was read from

    @property
    def activation(self) -> bool:
        return self.tensor.rsplit(".", 1)[-1] in ACTIVATION_SCALES

    def line(self) -> str:
        """One line naming the scale tensor and what is wrong with it."""
        message, _ = _describe(self.rule, self.counts, "this tensor")
        return f"scale tensor {self.tensor}: {message}"


def _longest_true_run(mask: np.ndarray) -> int:
    if not mask.any():
        return 0
    padded = np.concatenate(([0], mask.astype(np.int8), [0]))
    edges = np.flatnonzero(np.diff(padded))
    return int((edges[1::2] - edges[::2]).max())


def _as_matrix(arr: np.ndarray) -> np.ndarray:
    if arr.ndim == 0:
        return arr.reshape(1, 1)
    if arr.ndim == 1:
        return arr.reshape(1, -1)
    return arr.reshape(-1, arr.shape[-1])


def e8m0_matrix_issues(scales: np.ndarray, unit: str, part: str) -> list[Issue]:
    """Issues of one weight's E8M0 scale bytes [rows, blocks] (uint8; any shape is read as [-1, last dim])."""
    a = _as_matrix(np.asarray(scales, dtype=np.uint8))
    flat = a.reshape(-1)
    if flat.size == 0:
        return []
    lo, hi = int(flat.min()), int(flat.max())
    if lo > 0 and hi < 255:  # the common case: two vectorised reductions and done
        return []
    out = []
    total = int(flat.size)
    if hi == 255:
        out.append(Issue(unit, part, "e8m0-nan", "error", {"bad": int(np.count_nonzero(flat == 255)), "total": total}))
    if lo == 0:
        zero = a == 0
        n_zero = int(np.count_nonzero(zero))
        rows = zero.all(axis=1)
        n_rows, run = int(np.count_nonzero(rows)), _longest_true_run(rows)
        n_cols = int(np.count_nonzero(zero.all(axis=0)))
        counts = {"bad": n_zero, "total": total, "rows": n_rows, "row_total": int(a.shape[0]),
                  "cols": n_cols, "col_total": int(a.shape[1]), "run": run}
        if n_zero == total:
            out.append(Issue(unit, part, "e8m0-zero", "error", counts))
        elif a.shape[0] >= 2 and 2 * run >= a.shape[0]:
            out.append(Issue(unit, part, "e8m0-zero-rows", "error", counts))
        else:
            out.append(Issue(unit, part, "e8m0-zero-blocks", "warning", counts))
    return out


def _e4m3_values(raw: np.ndarray) -> np.ndarray:
    """float32 values of E4M3 (fn) bytes; only zero / NaN / sign matter here, so magnitudes are approximate."""
    b = raw.astype(np.int32)
    mag = b & 0x7F
    value = np.where(mag == 0x7F, np.nan, np.where(mag == 0, 0.0, 1.0)).astype(np.float32)
    return np.where(b & 0x80, -value, value)


def float_matrix_issues(values: np.ndarray, unit: str, part: str, activation: bool = False) -> list[Issue]:
    """Issues of one weight's (or activation's) float scales: NaN, inf, negative, zero."""
    v = np.asarray(values).reshape(-1)
    if v.size == 0:
        return []
    total = int(v.size)
    finite = np.isfinite(v)
    out = []
    if not finite.all():
        n_nan = int(np.count_nonzero(np.isnan(v)))
        out.append(Issue(unit, part, "fp-nonfinite", "error",
                         {"bad": total - int(np.count_nonzero(finite)), "total": total, "nan": n_nan}))
    n_neg = int(np.count_nonzero(v < 0))
    if n_neg:
        out.append(Issue(unit, part, "fp-negative", "error", {"bad": n_neg, "total": total}))
    n_zero = int(np.count_nonzero(v == 0))
    if n_zero:
        whole = n_zero == total
        rule = "fp-zero-activation" if activation else "fp-zero" if whole else "fp-zero-some"
        out.append(Issue(unit, part, rule, "error" if activation or whole else "warning",
                         {"bad": n_zero, "total": total}))
    return out


def tensor_issues(name: str, kind: str, arr: np.ndarray) -> list[Issue]:
    """Issues of scale tensor `name` of kind "e8m0" / "float" / "e4m3" (`scale_kind`) holding `arr`. Per-expert
    tensors are attributed to their expert; fused 3-D expert tensors [E, R, C] are checked expert by expert."""
    last = name.rsplit(".", 1)[-1]
    activation = last in ACTIVATION_SCALES
    m = _PER_EXPERT.match(name)
    if m:
        slices = [(m.group("unit"), m.group("part"), arr)]
    else:
        f = _FUSED_EXPERTS.match(name) if arr.ndim == 3 else None
        if f:
            slices = [(f"{f.group('unit')}.{e}", f.group("part"), arr[e]) for e in range(arr.shape[0])]
        else:
            slices = [(name, name, arr)]
    out: list[Issue] = []
    for unit, part, a in slices:
        if kind == "e8m0":
            out += e8m0_matrix_issues(a, unit, part)
        elif kind == "float":
            out += float_matrix_issues(a, unit, part, activation)
        elif kind == "e4m3":
            out += float_matrix_issues(_e4m3_values(np.asarray(a, dtype=np.uint8)), unit, part, activation)
    return [replace(issue, tensor=name) for issue in out]


# ---- issues -> findings --------------------------------------------------------------------------------------

def _pct(n: int, total: int) -> str:
    share = 100.0 * n / total if total else 0.0
    return f"{share:.3g}%" if share >= 0.01 or n == 0 else "<0.01%"


def _describe(rule: str, c: dict, parts: str) -> tuple[str, str]:
    bad, total = c["bad"], c["total"]
    if rule == "e8m0-nan":
        return (f"{bad} of {total} E8M0 scale bytes are 0xFF (NaN) in {parts}: every engine loads it and "
                f"computes NaN for those blocks",
                "re-quantize it from the source weights; 0xFF is never a valid MXFP4 scale")
    if rule == "e8m0-zero":
        return (f"all {total} E8M0 scale bytes are 0x00 (2^-127) in {parts}: the weights dequantize to zero, so "
                f"it outputs zero (calibration or weight loading never reached it)",
                "check that its source weights are not all zero and re-quantize it from them")
    if rule == "e8m0-zero-rows":
        return (f"{c['rows']} of {c['row_total']} rows of E8M0 scales are all 0x00 (a run of {c['run']} rows; "
                f"{bad} of {total} blocks, {_pct(bad, total)}) in {parts}: those output rows dequantize to zero",
                "check the source rows (a gate or up half never loaded?) and re-quantize it")
    if rule == "e8m0-zero-blocks":
        return (f"{bad} of {total} E8M0 scale blocks are 0x00 ({_pct(bad, total)}; {c['rows']} whole rows, "
                f"{c['cols']} whole 32-column groups) in {parts}: those 32-element blocks dequantize to zero",
                "fine only where the source blocks are all zeros; else re-quantize from the source")
    if rule == "fp-nonfinite":
        return (f"{bad} of {total} scales are not finite ({c['nan']} NaN, {bad - c['nan']} inf) in {parts}: the "
                f"engines compute NaN/inf with them",
                "re-quantize it (calibration never reached it, or an amax overflowed)")
    if rule == "fp-negative":
        return (f"{bad} of {total} scales are negative in {parts}: the engines flip those weights' signs",
                "re-quantize it; a scale is a magnitude")
    if rule == "fp-zero-activation":
        return (f"{bad} of {total} activation scales are zero in {parts}: the engines divide by it (inf/NaN) "
                f"or zero the input",
                "re-calibrate: calibration tokens never reached this module (use more data or route to it)")
    if rule == "fp-zero":
        return (f"all {total} scales are zero in {parts}: the weights dequantize to zero, so it outputs zero",
                "check that its source weights are not all zero and re-quantize it")
    return (f"{bad} of {total} scales are zero ({_pct(bad, total)}) in {parts}: those weights dequantize to zero",
            "fine only where the source weights are all zeros; else re-quantize from the source")


def group_issues(issues: list[Issue]) -> list[Finding]:
    """One Finding per (expert or tensor, rule): an expert's projections with the same problem become one line,
    "model.layers.3.mlp.experts.17 (gate_proj, up_proj, down_proj)"."""
    grouped: dict[tuple[str, str, str], list[Issue]] = {}
    for issue in issues:
        grouped.setdefault((issue.unit, issue.rule, issue.severity), []).append(issue)
    findings = []
    for (unit, rule, severity), group in grouped.items():
        parts = list(dict.fromkeys(i.part for i in group))
        is_tensor = parts == [unit]
        tensor = unit if is_tensor else f"{unit} ({', '.join(parts)})"
        counts: dict = {}
        for i in group:
            for k, v in i.counts.items():
                counts[k] = max(counts.get(k, 0), v) if k == "run" else counts.get(k, 0) + v
        where = "this tensor" if is_tensor else (f"{', '.join(parts)}" if len(parts) > 1 else parts[0])
        message, fix = _describe(rule, counts, where)
        findings.append(Finding(severity, "all", (), tensor, message, fix, RULE + rule))
    return findings


# ---- the file walk -----------------------------------------------------------------------------------------------

def _offsets(path: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """(start of the data region, name -> (begin, end) within it) from a shard's header."""
    _, start, offsets = read_header(path)
    return start, offsets


@dataclass
class ScanStats:
    tensors: int = 0
    bytes: int = 0
    files: int = 0


def scan_scales(path, metadata_dir=None, stats: ScanStats | None = None, threads: int | None = None) -> list:
    """`scan_issues`' findings, its issues grouped by expert (`group_issues`)."""
    findings, issues = scan_issues(path, metadata_dir, stats, threads)
    return findings + group_issues(issues)


def scan_issues(path, metadata_dir=None, stats: ScanStats | None = None,
                threads: int | None = None) -> tuple[list[Finding], list[Issue]]:
    """(findings of shards that could not be read, issues of every scale tensor) of the checkpoint at `path` (a
    directory, or an open `quant.checkpoint.Checkpoint`): E8M0 bytes of 0x00 / 0xFF, float scales of zero / inf /
    NaN / negative. `metadata_dir`: read config.json and the index from there (staged files).
    Reads only the scale tensors. Shards that cannot be read are skipped (the header preflight reports them);
    a read failing midway is an "integrity: corrupt-shard" finding. `stats`, when given, is filled in. Shards
    are read by `threads` threads (default: up to 4, at most the CPUs)."""

    ckpt = path if isinstance(path, Checkpoint) else open_checkpoint(path, metadata_dir)
    stats = stats if stats is not None else ScanStats()
    mx = declares_mx(ckpt.config)
    by_file: dict[str, list[tuple[str, str]]] = {}
    for name, info in ckpt.tensors.items():
        kind = scale_kind(name, info.dtype, mx)
        if kind is not None:
            by_file.setdefault(info.file, []).append((name, kind))
    files = sorted(by_file)
    workers = max(1, min(threads or min(4, os.cpu_count() or 1), len(files)))
    if workers == 1:
        results = [_scan_shard(ckpt, f, by_file[f]) for f in files]
    else:  # preads and numpy's reductions release the GIL: shards overlap I/O and checking

        with ThreadPoolExecutor(workers) as pool:
            results = list(pool.map(lambda f: _scan_shard(ckpt, f, by_file[f]), files))
    issues: list[Issue] = []
    findings: list[Finding] = []
    for shard_findings, shard_issues, shard_stats in results:
        findings += shard_findings
        issues += shard_issues
        stats.tensors += shard_stats.tensors
        stats.bytes += shard_stats.bytes
        stats.files += shard_stats.files
    return findings, issues


class _LocalShard:
    """One shard file's scale bytes: `start` of the data region, `offsets` name -> (begin, end) within it, and
    `read(ranges)` the bytes of (position, length) ranges in order, one `pread` each. A checkpoint that is not a
    directory provides its own through `open_shard(file)` (quant.hub: HTTP range requests, several in flight)."""

    def __init__(self, path: Path):
        self.start, self.offsets = _offsets(path)
        self.fd = os.open(path, os.O_RDONLY)
        if hasattr(os, "posix_fadvise"):  # small reads among the weights: no readahead into them
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)

    def read(self, ranges):
        return (os.pread(self.fd, length, pos) for pos, length in ranges)

    def close(self) -> None:
        os.close(self.fd)


def _scan_shard(ckpt, file: str, wanted_names: list[tuple[str, str]]) -> tuple[list[Finding], list[Issue], ScanStats]:
    stats = ScanStats()
    findings: list[Finding] = []
    issues: list[Issue] = []
    fpath = ckpt.shard_path(file)
    try:
        shard = ckpt.open_shard(file) if hasattr(ckpt, "open_shard") else _LocalShard(fpath)
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        return [_unreadable(fpath, None, e)], [], stats
    try:
        stats.files += 1
        offsets = shard.offsets
        wanted = sorted((offsets[n][0], n, k) for n, k in wanted_names if n in offsets)
        ranges = [(shard.start + begin, offsets[name][1] - begin) for begin, name, _ in wanted]
        for (_, name, kind), (_, length), raw in zip(wanted, ranges, shard.read(ranges)):
            info = ckpt.tensors[name]
            if len(raw) != length:
                findings.append(_unreadable(fpath, name, f"{len(raw)} of {length} bytes"))
                continue
            stats.tensors += 1
            stats.bytes += length
            issues += tensor_issues(name, kind, decode(raw, info.dtype, info.shape))
    except (OSError, ValueError) as e:
        findings.append(_unreadable(fpath, None, e))
    finally:
        shard.close()
    return findings, issues, stats


def _unreadable(path: Path, tensor: str | None, why) -> Finding:
    what = f"scale tensor {tensor}" if tensor else "its scale tensors"
    return Finding("error", "all", (), tensor or path.name, f"{path}: cannot read {what} ({str(why).splitlines()[0]})",
                   "re-copy the shard (it changed or was cut short after its header was read)",
                   "integrity: corrupt-shard")
