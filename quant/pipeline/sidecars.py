"""The export's record of its sidecars (the family's `sidecars`, quant/families/sidecars.py): which tables or files
the source's config declares, where each landed, its dtype, shape and the sha256 of its bytes as written (equal to
the source's: the planner copies sidecar tensors, and a sidecar file is copied byte for byte here)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

from quant.families import load_family, text_config
from quant.families.sidecars import expected_sidecars
from quant.files import sha256_file
from quant.safetensors_header import read_header

__all__ = ["sidecar_records", "sidecar_files_present", "sidecar_index"]


def _tensor_sha256(path: Path, name: str) -> tuple[str, list[int], str]:
    """(dtype, shape, sha256 of the tensor's bytes) of tensor `name` in the safetensors file `path`: its header and
    its own byte range only."""
    tensors, start, offsets = read_header(path)
    dtype, shape = tensors[name]
    begin, end = offsets[name]
    with open(path, "rb") as f:
        f.seek(start + begin)
        digest = hashlib.sha256(f.read(end - begin)).hexdigest()
    return dtype, list(shape), digest


def sidecar_files_present(family_name: str, config: dict, has_file: Callable[[str], bool]) -> list[str]:
    """The sidecar files the config declares and the source has (`has_file`: a directory's, or a Hub repository's
    file list; a draft beside the shards, possibly not in the index): copied into OUT byte for byte, as the side
    files are."""
    return [exp.file for exp in expected_sidecars(load_family(family_name).sidecars, text_config(config))
            if exp.file and has_file(exp.file)]


def sidecar_index(out: Path, copied: list[str]) -> tuple[dict[str, str], int]:
    """(weight_map entries, tensor bytes) of the sidecar files copied into `out`: the export's index lists them,
    since an engine that finds an index reads only the files it names (SGLang 0.5.23 model_loader/weight_utils.py
    filter_duplicate_safetensors_files :757-808, which drops every other *.safetensors at :807), and SGLang loads a
    bundled DSpark draft from the target's own directory (speculative_hook.py:720-735)."""
    entries, total = {}, 0
    for name in copied:
        tensors, _, offsets = read_header(Path(out) / name)
        entries.update(dict.fromkeys(tensors, name))
        total += sum(end - begin for begin, end in offsets.values())
    return entries, total


def sidecar_records(family_name: str, config: dict, out: Path, weight_map: dict[str, str],
                    file_sha256: Callable[[Path], str | None] = sha256_file) -> list[dict]:
    """quant_manifest.json `sidecars`: per declared sidecar its name, kind, declaring key and, per tensor, the
    output shard, dtype, shape and sha256 (or the file and its sha256, from `file_sha256`: the run's own record of
    what it wrote, so a multi-GB draft is read once)."""
    records = []
    for exp in expected_sidecars(load_family(family_name).sidecars, text_config(config)):
        record = {"name": exp.sidecar.name, "kind": exp.sidecar.kind, "declared_by": exp.sidecar.declared_by}
        if exp.file:
            path = Path(out) / exp.file
            record["file"] = {"name": exp.file, "sha256": file_sha256(path) if path.is_file() else None}
        else:
            record["tensors"] = {}
            for name in exp.tensors:
                shard = weight_map.get(name)
                if shard is None:
                    record["tensors"][name] = None  # the source lacked it: the preflight names it
                    continue
                dtype, shape, digest = _tensor_sha256(Path(out) / shard, name)
                record["tensors"][name] = {"file": shard, "dtype": dtype, "shape": shape, "sha256": digest}
        records.append(record)
    return records
