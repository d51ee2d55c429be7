"""The source formats, read from their data file (quant/manifests/source_formats.yaml `encodings`: one row per
format, in the order they are tried, each naming the class in quant/sources/ that owns its behaviour), and the
questions asked of all of them at once: which format a stored weight is in, which tensors a format consumes with
its weights, which name a format is. The planner, the reader and the toys all ask this registry, so a format added
to the data file (with its module) is recognised, decoded and written everywhere.

The same file's `formats` are the release storages a toy can be written in (`quant toy --source-format`), each
naming the formats its roles are encoded in."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quant.errors import QuantError
from quant.families.schema import BadData, check_keys, load_yaml
from quant.paths import MANIFESTS_DIR
from quant.sources.source_format import CLAIMS, MICROSCALED, Encoding, Headers, SourceFormat

if TYPE_CHECKING:
    import torch

SOURCE_FORMATS = MANIFESTS_DIR / "source_formats.yaml"
TOP_KEYS = ("encodings", "formats")
ENCODING_KEYS = ("class", "release", "weight", "scale", "code_dtypes", "scale_dtypes", "blocks", "packed",
                 "global_scale", "consumed", "checkpoint", "claims")
RELEASE_KEYS = ("release", "encode", "roles", "fp8_block", "ignore_key", "ignore_extra", "quantization_config")
REQUIRED = ("class", "release", "weight", "scale", "code_dtypes", "scale_dtypes", "blocks")


@dataclass(frozen=True)
class Registry:
    """Every source format, in the order they are tried, and the release storages a toy can be written in."""

    formats: tuple[SourceFormat, ...]
    releases: dict[str, dict[str, Any]]

    def named(self, name: str) -> SourceFormat:
        for fmt in self.formats:
            if fmt.name == name:
                return fmt
        raise QuantError(f"unknown source format {name!r} (use one of {', '.join(f.name for f in self.formats)})")

    def candidates(self, weight: str) -> Iterator[tuple[SourceFormat, str]]:
        """(format, module) for every microscaled format whose weight suffix `weight` ends with."""
        for fmt in self.formats:
            if fmt.checkpoint == MICROSCALED and weight.endswith(fmt.weight):
                yield fmt, weight[: -len(fmt.weight)]


def _format(name: str, row: object, where: str) -> SourceFormat:
    row = check_keys(row, ENCODING_KEYS, where, f"encoding {name!r}")
    missing = [k for k in REQUIRED if k not in row]
    if missing:
        raise BadData(f"{where}: encoding {name!r} lacks {', '.join(missing)}")
    module_name, _, class_name = str(row["class"]).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as e:
        raise BadData(f"{where}: encoding {name!r}: class {row['class']!r} cannot be imported ({e})") from None
    if not (isinstance(cls, type) and issubclass(cls, SourceFormat)):
        raise BadData(f"{where}: encoding {name!r}: {row['class']} is not a quant.sources.source_format.SourceFormat")
    if row.get("claims", "names") not in CLAIMS:
        raise BadData(f"{where}: encoding {name!r}: claims {row['claims']!r} is not one of {', '.join(CLAIMS)}")
    try:
        return cls(name=name, release=str(row["release"]), weight=str(row["weight"]), scale=str(row["scale"]),
                   code_dtypes=tuple(row["code_dtypes"]), scale_dtypes=tuple(row["scale_dtypes"]),
                   blocks=tuple((int(b[0]), int(b[1])) for b in row["blocks"]), packed=bool(row.get("packed")),
                   global_scale=str(row.get("global_scale") or ""), consumed=tuple(row.get("consumed") or ()),
                   checkpoint=str(row.get("checkpoint") or MICROSCALED), claims=str(row.get("claims") or "names"))
    except (TypeError, ValueError, IndexError) as e:
        raise BadData(f"{where}: encoding {name!r} is malformed ({e})") from None


def _releases(table: dict[str, object], names: set[str], where: str) -> dict[str, dict[str, Any]]:
    out = {}
    for name, spec in table.items():
        spec = check_keys(spec, RELEASE_KEYS, where, f"format {name!r}")
        roles = spec.get("roles") or {}
        used = set(roles.values()) if isinstance(roles, dict) else {spec.get("encode")}
        unknown = sorted(str(u) for u in used - names)
        if unknown:
            raise BadData(f"{where}: format {name!r} encodes in {', '.join(unknown)}, not an encoding of this file")
        out[str(name)] = dict(spec)
    return out


@cache
def load(path: Path) -> Registry:
    """The registry of data file `path`; an unknown key is refused in one line naming the file and the key."""
    where = str(path)
    data = check_keys(load_yaml(path), TOP_KEYS, where)
    rows = data.get("encodings")
    if not isinstance(rows, dict) or not rows:
        raise BadData(f"{where}: `encodings` must map each source format name to its row")
    formats = tuple(_format(str(name), row, where) for name, row in rows.items())
    if not isinstance(data.get("formats") or {}, dict):
        raise BadData(f"{where}: `formats` must map each release storage name to its spec")
    return Registry(formats, _releases(data.get("formats") or {}, {f.name for f in formats}, where))


def current() -> Registry:
    """The registry every reader of sources uses: the package's data file (QUANT_MANIFESTS_DIR's, when set)."""
    return load(SOURCE_FORMATS)


def format_named(name: str) -> SourceFormat:
    return current().named(name)


def missing_scale(tensors: Headers, name: str) -> str | None:
    """The scale tensor a stored weight named only as packed codes are (`X.weight_packed`) needs and lacks: such a
    tensor is no plain weight, and without its scale it cannot be decoded (None when `name` is no such tensor, or
    its scale is present)."""
    for fmt, module in current().candidates(name):
        if fmt.weight != ".weight" and module + fmt.scale not in tensors:
            return module + fmt.scale
    return None


def _claimed(fmt: SourceFormat, tensors: Headers, weight: str, scale: str) -> bool:
    return scale in tensors and fmt.claims_pair(tensors[weight].dtype, tensors[scale].dtype)


def scale_tensors(tensors: Headers) -> set[str]:
    """The names in `tensors` (name -> info with .dtype/.shape) that belong to a stored weight of a microscaled
    format: its scales, global scales and consumed siblings (each decoded or dropped with its weight)."""
    out = set()
    registry = current()
    for name in tensors:
        for fmt, module in registry.candidates(name):
            if _claimed(fmt, tensors, name, module + fmt.scale):
                out.add(module + fmt.scale)
                siblings = [module + fmt.global_scale] if fmt.global_scale else []
                out.update(s for s in siblings + [module + c for c in fmt.consumed] if s in tensors)
    return out


def recognise(tensors: Headers, weight: str, where: str = "") -> Encoding | None:
    """The Encoding of `weight` from headers alone (`tensors`: name -> info with .dtype and .shape), None when
    it has no scale sibling of a microscaled format (a plain BF16/F32 tensor, or a block-FP8 one with an F32
    weight_scale_inv). A weight or scale whose dtype or shape fits no format is refused, naming both tensors."""
    where = where or weight
    registry = current()
    for fmt, module in registry.candidates(weight):
        scale = module + fmt.scale
        if not _claimed(fmt, tensors, weight, scale):
            continue
        w, s = tensors[weight], tensors[scale]
        same_names = [f for f, _ in registry.candidates(weight) if f.scale == fmt.scale]
        if not any(f.stores(w.dtype, s.dtype) for f in same_names):
            raise QuantError(f"{where}: {fmt.pair_mismatch(weight, w.dtype, scale, s.dtype, same_names)}")
        if fmt.stores(w.dtype, s.dtype):
            return fmt.recognise(tensors, weight, where)
        # else: the other format with these names (MXFP4 vs UE8M0 FP8, compressed-tensors MXFP4 vs NVFP4)
    return None


def decode(encoding: Encoding, weight: torch.Tensor, scale: torch.Tensor, what: str = "",
           global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 values of a stored weight and its scale tensor (and NVFP4's global scale) under `encoding`."""
    return format_named(encoding.kind).decode(encoding, weight, scale, what, global_scale)


def encode_as(name: str, x: torch.Tensor, block: int = 128) -> dict[str, torch.Tensor]:
    """A 2-D weight written in format `name` as its release stores it: {tensor-name suffix: tensor}; `block`: the
    square block of UE8M0 FP8 (128 or 32)."""
    return format_named(name).encode(x, block)


def release_storages() -> dict[str, dict[str, Any]]:
    """The data file's `formats`: the release storages a toy can be written in."""
    return current().releases
