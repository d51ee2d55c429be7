"""Sidecars: what a release ships beside its decoder weights that the engine needs but no quantizer should touch
(DeepSeek-V4.1's FP8 Engram hash tables, a separate DSpark draft file), declared as data in the family file's
`sidecars` key (manifests/families/deepseek_v4.yaml documents the keys).

A sidecar is declared by a key of the (text) config: present and non-empty means the release must carry it. It is
either tensors of the checkpoint (`tensors`: name templates over `{i}`, the declaring list's values, and `{k}`,
their positions; each with the dtype and shape the engine allocates, arithmetic over the config's keys, lists
indexable: `engram_num_embeddings[k]`), or a file beside the shards (`file`, possibly in the index). The planner
copies sidecar tensors as stored and leaves a sidecar file out of its shards (the pipeline copies it byte for
byte), the manifest lists them with the sha256 of their bytes, and the preflight (quant/verify/sidecars.py) fails
an export that lacks one or whose dtype/shape differs. A sidecar file's tensors stay modules to the preflight's
quantization_config checks: an engine builds a draft with the target's quantization_config.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from quant.families.schema import BadData, check_keys

__all__ = ["Sidecar", "Expected", "FileTensor", "parse_sidecars", "sidecar_pattern", "expected_sidecars",
           "sidecar_files"]

SIDECAR_KEYS = ("kind", "declared_by", "tensors", "file", "source", "layers", "ignored")
TENSOR_KEYS = ("dtype", "shape", "required")
KINDS = ("table", "draft", "file")


@dataclass(frozen=True)
class Sidecar:
    name: str
    kind: str  # table (tensors in the shards) | draft | file (a file of its own beside the shards)
    declared_by: str  # the text-config key declaring it
    tensors: dict[str, dict] = field(default_factory=dict)  # name template -> {dtype, shape: [expr, ...]}
    file: str | None = None
    source: str = ""  # where the engine's dtype/shape come from (file:line), shown in findings
    # A file sidecar's contents, what the engine's class for it allocates and its loader requires: name template
    # (`{i}` over range(`layers`), a dotted text-config key) -> {dtype: one or a list, shape, required}.
    contents: dict[str, dict] = field(default_factory=dict)
    layers: str | None = None
    ignored: tuple[str, ...] = ()  # substrings of names in the file the engine's loader skips


@dataclass(frozen=True)
class FileTensor:
    """A tensor a sidecar file must (or, `required` False, may) hold: its dtypes and shape (None: a formula the
    config cannot evaluate)."""

    dtypes: tuple[str, ...]
    shape: tuple[int, ...] | None
    required: bool = True


@dataclass(frozen=True)
class Expected:
    """One sidecar a config declares: its tensors with the dtype and shape the engine builds (shape None: a
    formula the config cannot evaluate), or its file and what the file must hold (`contents`)."""

    sidecar: Sidecar
    tensors: dict[str, tuple[str, tuple[int, ...] | None]]
    file: str | None
    contents: dict[str, FileTensor] = field(default_factory=dict)

    def unexpected(self, name: str) -> bool:
        """Whether a tensor of the sidecar's file is one its engine's loader has no parameter for (it raises)."""
        return name not in self.contents and not any(part in name for part in self.sidecar.ignored)


def parse_sidecars(value, where: str) -> list[Sidecar]:
    """The family file's `sidecars: {name: spec}`, strictly (an unknown key is an error naming it)."""
    if value is None:
        return []
    if not isinstance(value, dict):
        raise BadData(f"{where}: sidecars must be a mapping of sidecar name -> spec")
    out = []
    for name, spec in value.items():
        spec = check_keys(spec, SIDECAR_KEYS, where, f"sidecars.{name}")
        kind, tensors, file = spec.get("kind"), spec.get("tensors") or {}, spec.get("file")
        if kind not in KINDS or not isinstance(spec.get("declared_by"), str):
            raise BadData(f"{where}: sidecars.{name} needs kind ({' | '.join(KINDS)}) and declared_by (a config key)")
        if not tensors and not file:
            raise BadData(f"{where}: sidecars.{name} names tensors or a file (a file may list its tensors too)")
        for tensor, tspec in tensors.items():
            tspec = check_keys(tspec, TENSOR_KEYS, where, f"sidecars.{name}.tensors.{tensor}")
            dtype = tspec.get("dtype")
            dtypes_ok = isinstance(dtype, str) or (bool(file) and isinstance(dtype, list) and dtype
                                                   and all(isinstance(d, str) for d in dtype))
            if not dtypes_ok or not isinstance(tspec.get("shape"), list):
                raise BadData(f"{where}: sidecars.{name}.tensors.{tensor} needs dtype and shape [expr, ...]")
        layers, ignored = spec.get("layers"), spec.get("ignored") or []
        if (layers is not None or ignored) and not (file and tensors):
            raise BadData(f"{where}: sidecars.{name}: layers and ignored describe a file's tensors")
        if layers is not None and not isinstance(layers, str):
            raise BadData(f"{where}: sidecars.{name}.layers must be a dotted config key")
        in_file = dict(tensors) if file else {}
        out.append(Sidecar(name, kind, spec["declared_by"], {} if file else dict(tensors), file,
                           str(spec.get("source", "")), in_file, layers, tuple(map(str, ignored))))
    return out


def _template_regex(template: str) -> str:
    return "^" + re.escape(template).replace(r"\{i\}", r"\d+").replace(r"\{k\}", r"\d+") + "$"


def sidecar_pattern(sidecars: list[Sidecar]) -> re.Pattern | None:
    """A regex matching every tensor any of `sidecars` can name (config-independent: the planner copies them)."""
    parts = [_template_regex(t) for s in sidecars for t in s.tensors]
    return re.compile("|".join(parts)) if parts else None


def _values(text: dict, prefix: str = "") -> dict:
    """The config's integers and lists of integers, the names a shape formula may use: nested dicts flattened with
    "_" (dspark_config.ffn_hidden_size -> dspark_config_ffn_hidden_size), a list's length as len_<name>."""
    def ok(v):
        return isinstance(v, int) and not isinstance(v, bool)
    out: dict = {}
    for key, value in text.items():
        if isinstance(value, dict):
            out.update(_values(value, f"{prefix}{key}_"))
        elif ok(value) or (isinstance(value, list) and value and all(ok(x) for x in value)):
            out[prefix + key] = value
            if isinstance(value, list):
                out[f"len_{prefix}{key}"] = len(value)
    return out


def _lookup(text: dict, dotted: str):
    value = text
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _shape(exprs: list, values: dict) -> tuple[int, ...] | None:
    dims = []
    for expr in exprs:
        try:
            # The family's own manifest data evaluated over the config's integers (as quant.families.shapes does).
            dim = eval(compile(str(expr), "<sidecar shape>", "eval"), {"__builtins__": {}}, values)
        except (NameError, SyntaxError, TypeError, IndexError, ZeroDivisionError, ValueError):
            return None
        if not isinstance(dim, int) or dim <= 0:
            return None
        dims.append(dim)
    return tuple(dims)


def expected_sidecars(sidecars: list[Sidecar], text: dict) -> list[Expected]:
    """The sidecars the text config `text` declares, each with the tensors (name -> (dtype, shape)) or file the
    export must carry. A list-valued declaring key (engram_layer_ids) expands `{i}` over its values."""
    out = []
    for sidecar in sidecars:
        declared = text.get(sidecar.declared_by)
        if not declared:
            continue
        positions = list(enumerate(declared)) if isinstance(declared, list) else [(0, 0)]
        tensors = {}
        for k, i in positions:
            values = {**_values(text), "k": k, "i": i}
            for template, spec in sidecar.tensors.items():
                tensors[template.format(i=i, k=k)] = (spec["dtype"], _shape(spec["shape"], values))
        out.append(Expected(sidecar, tensors, sidecar.file, _contents(sidecar, text)))
    return out


def _contents(sidecar: Sidecar, text: dict) -> dict[str, FileTensor]:
    """What the sidecar's file must hold under this config: each template once per layer (`{i}`)."""
    if not sidecar.contents:
        return {}
    count = _lookup(text, sidecar.layers) if sidecar.layers else 1
    if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count < 1 << 16:
        return {}  # a count the config does not give: nothing to compare (the config checks name it)
    out = {}
    values = _values(text)
    for template, spec in sidecar.contents.items():
        dtypes = (spec["dtype"],) if isinstance(spec["dtype"], str) else tuple(spec["dtype"])
        for i in range(count) if "{i}" in template else [0]:
            out[template.format(i=i)] = FileTensor(dtypes, _shape(spec["shape"], {**values, "i": i}),
                                                   bool(spec.get("required", True)))
    return out


def sidecar_files(sidecars: list[Sidecar], text: dict) -> set[str]:
    """The files of the sidecars the text config `text` declares: shipped beside the shards, never planned as one
    (the pipeline copies them byte for byte)."""
    return {exp.file for exp in expected_sidecars(sidecars, text) if exp.file}
