"""Tiny, seeded MoE checkpoints with the real tensor names, built on CPU in seconds (`quant toy`).

The weights come from the family's transformers class (`from_config` + `save_pretrained`), so names, shapes and
expert layout are exactly what transformers writes. On top of that this module adds what transformers never
writes (the MTP layer's extras, F32 routing bias, non-constant norms), optionally turns the model into an
official-style block-FP8 source, and writes shards, index, config, generation config and the byte-level
tokenizer. Toy knowledge (dimensions, MTP extras, what the FP8 release quantizes) lives in the toy file beside
the family's record, `manifests/toys/<family>.yaml` under `toys`; `manifests/toys.yaml` documents the keys and
holds what all toys share (their order, the official block-FP8 quantization_config, the named perturbation
tables).

Same name, seed and options give byte-identical files.
"""

from __future__ import annotations

import copy
import inspect
import json
import re
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

from quant.errors import QuantError
from quant.families import family_for_config, family_names, load_family, text_config
from quant.families.mtp import NEXTN_COUNT_KEY
from quant.families.schema import BadData, check_keys, load_yaml
from quant.paths import MANIFESTS_DIR
from quant.sources.registry import encode_as, release_storages
from quant.toy.release import FILE_KEYS, RELEASE_EXTRAS_KEYS, encode_rows, merge_into, release_extras, release_file
from quant.toy.tokenizer import EOS_TOKEN, PAD_TOKEN, VOCAB_SIZE, save_toy_tokenizer, toy_tokenizer

__all__ = ["TOY_NAMES", "build_toy", "toy_family", "toy_tokenizer", "parse_shard_size", "write_safetensors"]

TOYS_MANIFEST = MANIFESTS_DIR / "toys.yaml"
TOYS_DIR = MANIFESTS_DIR / "toys"  # <family>.yaml: that family's toys, beside its record in manifests/families/
TOY_FILE_KEYS = ("toys",)
# The keys toys.yaml may hold (the manifest's header documents each); anything else is a misspelling.
MANIFEST_KEYS = ("order", "quantization_config", "perturbations")
# The keys of a toy (a `toys` entry of a toy file; toys.yaml's header documents each).
TOY_KEYS = ("config_class", "model_class", "text_config_key", "text_prefix", "config", "release_config",
            "fused_experts", "mtp_layers", "mtp", "f32_tensors", "perturb_base", "perturb", "config_json_renames",
            "renames", "fp8_block", "native", "release_files", "layout", "release_format",
            "release_ignore", "release_extras")
TOY_MTP_KEYS = ("layer_prefix", "extras_prefix", "extras", "fused_experts", "layer_type", "mlp_layer_type", "drop")
TOY_NATIVE_KEYS = ("mxfp4", "fp8_ue8m0", "bf16_tensors", "quantization_config", "fp8_block")
TOY_FP8_KEYS = ("quantize", "modules_to_not_convert", "keep_unmatched_modules", "fused_experts",
                "quantization_config")

# config.json lists with one entry per decoder layer; the MTP layer is built as an extra decoder layer and then
# dropped from these lists, as in the real configs.
PER_LAYER_CONFIG_KEYS = ("layer_types", "mlp_layer_types", "indexer_types")
# Initialisers for MTP extras, by the kind named in the toy's `mtp.extras` (H = hidden size).
MTP_INIT_KINDS = ("ones", "zeros", "projection", "square", "copy:")


@dataclass(frozen=True)
class Fp8Release:
    """What an official block-FP8 release of the family quantizes and lists in `modules_to_not_convert`."""

    quantize: tuple[re.Pattern, ...]
    modules_to_not_convert: tuple[str, ...]
    keep_unmatched_modules: bool
    fused_experts: bool | None
    quantization_config: dict  # keys the release's quantization_config adds (DeepSeek-V3.2: scale_fmt ue8m0)

    def quantizes(self, tensor: str) -> bool:
        return any(p.search(tensor) for p in self.quantize)


@dataclass(frozen=True)
class ToyMtp:
    """How a toy writes its MTP layers, where its family stores them: DeepSeek/GLM as extra decoder layers
    `model.layers.{N+k}.*` with their extras beside the block; Qwen3.5 under its own namespace, `mtp.layers.{k}.*`
    plus `mtp.fc` etc."""

    count_key: str  # config.json key holding the number of MTP layers: the family's (quant/families/mtp.py)
    layer_prefix: str  # "{text}layers.{n}." or "mtp.layers.{k}." (text = the text model prefix, n = N + k)
    extras_prefix: str  # where the extras live: "{text}layers.{n}." or "mtp."
    extras: dict[str, str]
    fused_experts: bool | None  # None: as the main layers
    layer_type: str | None  # layer_types entry of the decoder layer built for the MTP block
    mlp_layer_type: str = "moe"  # its mlp_layer_types entry, where the config has that list
    drop: tuple[re.Pattern, ...] = ()  # block tensors the release's MTP layer lacks (GLM-5.3-Flash: no mHC)


@dataclass(frozen=True)
class ToyFamily:
    """A toy: `name` (what `quant toy` takes) of the model family `family` (its file manifests/families/FAMILY.yaml
    holds the toy under `toys`)."""

    name: str
    config_class: str | None  # None: a layout toy (quant/toy/layout.py), no transformers class
    model_class: str | None  # transformers class when not AutoModelForCausalLM (vision-language wrappers)
    text_config_key: str | None  # "text_config" for wrappers: the language model's keys live there
    text_prefix: str  # tensor-name prefix of the language model ("model." or "model.language_model.")
    config: dict
    release_config: dict
    fused_experts: bool
    mtp_layers: int
    mtp: ToyMtp | None
    f32_tensors: tuple[re.Pattern, ...]
    perturb: dict[str, float]
    config_json_renames: dict[str, str]
    fp8: Fp8Release
    renames: tuple[tuple[re.Pattern, str], ...] = ()  # tensor-name fixes after transformers' save (release names)
    native: dict | None = None  # a release that ships microscaled (DeepSeek-V4): the toy's `native`
    release_files: dict | None = None  # JSON side files the release ships (file name -> content), e.g. Kimi-K2.5's
    #                                    preprocessor_config.json, which vLLM reads even for a text-only run
    layout: dict | None = None  # every tensor of a family transformers has no class for (quant/toy/layout.py)
    release_format: str | None = None  # the release's storage (a source format) the toy is written in by default
    release_ignore: tuple[str, ...] = ()  # the release's own ignore list for it (else the format's, per module)
    release_extras: dict | None = None  # what the release adds to the transformers model (quant/toy/release.py)
    family: str | None = None  # the model family whose file defines the toy
    file: Path | None = None  # that file


@cache
def _manifest(path: Path = TOYS_MANIFEST, toys_dir: Path | None = None) -> dict:
    """toys.yaml with every toy gathered from the toy files (`toys_dir`, default manifests/toys: one <family>.yaml
    beside each family's record) under "toys" as {name: (family, file, spec)}: the toys toys.yaml's `order` lists
    first, in that order, then any other by name; each spec checked against the toy keys and its `perturb_base`
    resolved into `perturb`."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise BadData(f"{path}: cannot read the toy manifest ({e})") from e
    check_keys(data, MANIFEST_KEYS, str(path))
    order = data.get("order")
    if not isinstance(order, list) or not all(isinstance(n, str) for n in order) or len(set(order)) != len(order):
        raise BadData(f"{path}: 'order' must list toys once each, by name")
    tables = data.get("perturbations") or {}
    if not isinstance(tables, dict) or not all(isinstance(t, dict) for t in tables.values()):
        raise BadData(f"{path}: 'perturbations' must map a table name to {{regex: std}}")
    found: dict[str, tuple[str, Path, dict]] = {}
    families = set(family_names())
    for file in sorted((toys_dir or TOYS_DIR).glob("*.yaml")):
        for name, spec in _toy_file(file, families).items():
            where = f"{file}: toys.{name}"
            if name in found:
                raise BadData(f"{where}: toy {name!r} is already defined in {found[name][1]}")
            found[name] = (file.stem, file, _with_perturb_base(spec, tables, where))
    unknown = [n for n in order if n not in found]
    if unknown:
        raise BadData(f"{path}: 'order' lists {', '.join(unknown)}, which no toy file defines")
    data["toys"] = {name: found[name] for name in [*order, *sorted(n for n in found if n not in order)]}
    return data


def _toy_file(file: Path, families: set[str]) -> dict[str, dict]:
    """The toys of one toy file, each spec's keys checked; refused (BadData naming the file) when its name is no
    model family's."""
    if file.stem not in families:
        raise BadData(f"{file}: no model family {file.stem!r} (manifests/families/{file.stem}.yaml) holds these toys")
    toys = check_keys(load_yaml(file), TOY_FILE_KEYS, str(file)).get("toys")
    if not isinstance(toys, dict) or not all(isinstance(k, str) and isinstance(v, dict) for k, v in toys.items()):
        raise BadData(f"{file}: toys must be a mapping of toy name -> toy spec (manifests/toys.yaml lists the keys)")
    for name, spec in toys.items():
        where = f"{file}: toys.{name}"
        check_keys(spec, TOY_KEYS, where)
        check_keys(spec.get("mtp"), TOY_MTP_KEYS, where, "mtp")
        check_keys(spec.get("fp8_block"), TOY_FP8_KEYS, where, "fp8_block")
        check_keys(spec.get("native"), TOY_NATIVE_KEYS, where, "native")
        check_keys(spec.get("release_extras"), RELEASE_EXTRAS_KEYS, where, "release_extras")
        check_keys((spec.get("release_extras") or {}).get("file"), FILE_KEYS, where, "release_extras.file")
    return toys


def _with_perturb_base(spec: dict, tables: dict, where: str) -> dict:
    """The toy spec with `perturb` = its `perturb_base` table's entries (toys.yaml `perturbations`), then its own."""
    base = spec.get("perturb_base")
    if base is None:
        return spec
    if base not in tables:
        raise BadData(f"{where}: perturb_base {base!r} is not a table of {TOYS_MANIFEST.name} `perturbations` "
                      f"(known: {', '.join(tables) or 'none'})")
    return {**spec, "perturb": {**tables[base], **(spec.get("perturb") or {})}}


def toy_names() -> tuple[str, ...]:
    """The toys, in manifests/toys.yaml's `order`."""
    return tuple(_manifest()["toys"])


TOY_NAMES = toy_names()


def toy_family(name: str) -> ToyFamily:
    """The toy `name` from its toy file (manifests/toys/<family>.yaml); QuantError listing the valid names otherwise."""
    toys = _manifest()["toys"]
    if name not in toys:
        raise QuantError(f"unknown toy {name!r}; valid names: {', '.join(toys)}")
    family, file, spec = toys[name]
    fp8 = spec.get("fp8_block") or {}
    mtp = spec.get("mtp")
    for kind in (mtp or {}).get("extras", {}).values():
        if not kind.startswith(MTP_INIT_KINDS):
            raise QuantError(f"{file}: toys.{name}: unknown MTP init {kind!r} (use one of {MTP_INIT_KINDS})")
    return ToyFamily(
        name=name,
        config_class=spec.get("config_class"),
        model_class=spec.get("model_class"),
        text_config_key=spec.get("text_config_key"),
        text_prefix=spec.get("text_prefix", "model."),
        config=dict(spec["config"]),
        release_config=dict(spec.get("release_config", {})),
        fused_experts=bool(spec.get("fused_experts", False)),
        mtp_layers=int(spec.get("mtp_layers", 0)),
        mtp=ToyMtp(
            count_key=load_family(family).mtp.count_key,
            layer_prefix=mtp.get("layer_prefix", "{text}layers.{n}."),
            extras_prefix=mtp.get("extras_prefix", "{text}layers.{n}."),
            extras=dict(mtp.get("extras", {})),
            fused_experts=mtp.get("fused_experts"),
            layer_type=mtp.get("layer_type"),
            mlp_layer_type=mtp.get("mlp_layer_type", "moe"),
            drop=tuple(re.compile(p) for p in mtp.get("drop", [])),
        ) if mtp else None,
        f32_tensors=tuple(re.compile(p) for p in spec.get("f32_tensors", [])),
        perturb=dict(spec.get("perturb", {})),
        config_json_renames=dict(spec.get("config_json_renames", {})),
        fp8=Fp8Release(
            quantize=tuple(re.compile(p) for p in fp8.get("quantize", [])),
            modules_to_not_convert=tuple(fp8.get("modules_to_not_convert", [])),
            keep_unmatched_modules=bool(fp8.get("keep_unmatched_modules", False)),
            fused_experts=fp8.get("fused_experts"),
            quantization_config=dict(fp8.get("quantization_config") or {}),
        ),
        renames=tuple((re.compile(p), r) for p, r in (spec.get("renames") or {}).items()),
        native=dict(spec["native"]) if spec.get("native") else None,
        release_files=dict(spec.get("release_files") or {}),
        layout=dict(spec["layout"]) if spec.get("layout") else None,
        release_format=spec.get("release_format"),
        release_ignore=tuple(spec.get("release_ignore") or ()),
        release_extras=dict(spec["release_extras"]) if spec.get("release_extras") else None,
        family=family,
        file=file,
    )


def parse_shard_size(value: int | str | None) -> int | None:
    """Bytes from `1048576`, `"1048576"`, `"500KB"`, `"2MB"`, `"1GB"` (quant.units.parse_size)."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise QuantError(f"shard size {value!r}: must be a positive number of bytes")
        return value
    from quant.units import parse_size

    return parse_size(value, "shard size")


def build_toy(
    name: str,
    out: str | Path,
    *,
    fp8_block: bool = False,
    shard_size: int | str | None = None,
    seed: int = 0,
    overrides: dict | None = None,
    force: bool = False,
    in_place: bool = False,
    source_format: str | None = None,
) -> Path:
    """Write the toy checkpoint `name` to `out` and return `out`.

    `overrides` replaces keys of the family's config (e.g. `{"num_hidden_layers": 3}`); the family's MTP count
    key (or the NextN one) sets the number of MTP layers. `out` must be absent or empty unless `force`.
    The checkpoint is built in a temporary sibling directory and renamed into place, so a crash never leaves a
    complete-looking `out`.
    """
    family = toy_family(name)
    out = Path(out)
    max_shard_size = parse_shard_size(shard_size)
    source_format_spec(source_format)  # an unknown format is refused before anything is written
    if in_place:  # `out` is a fresh scratch directory of the caller's (quant toy stages into one of its own)
        out.mkdir()
        _write_toy(family, out, fp8_block=fp8_block, max_shard_size=max_shard_size, seed=seed,
                   overrides=overrides or {}, source_format=source_format)
        return out
    _check_destination(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Not mkdtemp: its directory is owner-only, and a checkpoint is shared data (mkdir honours the umask).
    staging = out.parent / f".{out.name}.tmp-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        _write_toy(family, staging, fp8_block=fp8_block, max_shard_size=max_shard_size, seed=seed,
                   overrides=overrides or {}, source_format=source_format)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _check_destination(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise QuantError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise QuantError(f"{out}: directory is not empty (use --force to replace it)")


def _write_toy(family: ToyFamily, directory: Path, *, fp8_block: bool, max_shard_size: int | None, seed: int,
               overrides: dict, source_format: str | None = None) -> None:
    with _cpu_independent_numerics():
        _write_toy_files(family, directory, fp8_block=fp8_block, max_shard_size=max_shard_size, seed=seed,
                         overrides=overrides, source_format=source_format)


def _write_toy_files(family: ToyFamily, directory: Path, *, fp8_block: bool, max_shard_size: int | None, seed: int,
                     overrides: dict, source_format: str | None = None) -> None:
    import torch

    if family.layout:
        return _write_layout_toy(family, directory, fp8_block=fp8_block, max_shard_size=max_shard_size, seed=seed,
                                 overrides=overrides, source_format=source_format)
    if fp8_block and family.release_format:
        raise QuantError(f"toy {family.name}: no block-FP8 release of this model (its release is "
                         f"{family.release_format})")
    config, n_main, n_mtp = _model_config(family, overrides)
    fused = family.fused_experts
    if fp8_block and family.fp8.fused_experts is not None:
        fused = family.fp8.fused_experts
    mtp_fused = fused if family.mtp is None or family.mtp.fused_experts is None or fp8_block \
        else family.mtp.fused_experts
    tensors, config_json = _transformers_checkpoint(family, config, seed=seed, fused_experts=fused,
                                                    mtp_fused_experts=mtp_fused, n_main=n_main, n_mtp=n_mtp)

    generator = torch.Generator().manual_seed(seed)
    tensors.update(_mtp_extras(family, tensors, config_json, n_main, n_mtp, generator))
    tensors = _natural_order(tensors)
    _cast_f32(tensors, family.f32_tensors)
    _perturb(tensors, family.perturb, generator)
    config_json = _release_config_json(family, config_json, n_main, n_mtp)
    side_file = None  # a file the release ships beside the shards (MiniMax-M3.1's DSpark draft)
    if family.release_extras:  # DeepSeek-V4.1: Engram, DSpark heads, vision, nested config (quant/toy/release.py)
        tensors, config_json = release_extras(family.release_extras, tensors, config_json, n_mtp, seed)
        side_file, config_json = release_file(family.release_extras, config_json, seed)
    if family.native and not fp8_block:
        tensors = _microscale(tensors, family.native)
        config_json["quantization_config"] = dict(family.native.get("quantization_config") or {})
    if family.release_extras and not fp8_block:
        tensors = encode_rows(tensors, family.release_extras.get("fp8_rows"))
    if fp8_block:
        tensors = _quantize_fp8_block(tensors, family.fp8)
        config_json["quantization_config"] = _quantization_config(family.fp8, tensors, n_main + n_mtp)
    fmt = source_format or (None if fp8_block else family.release_format)
    if fmt:
        tensors, config_json["quantization_config"] = _in_source_format(tensors, config_json, fmt)

    _write_files(family, directory, tensors, config_json, max_shard_size, side_file)


def _write_layout_toy(family: ToyFamily, directory: Path, *, fp8_block: bool, max_shard_size: int | None, seed: int,
                      overrides: dict, source_format: str | None) -> None:
    """A toy of a family transformers has no class for: tensors from its layout (quant/toy/layout.py), config.json
    the release's, stored as the release stores it (`release_format`, a source format) unless `source_format` names
    another."""
    import torch

    from quant.toy.layout import layout_checkpoint

    if fp8_block:
        raise QuantError(f"toy {family.name}: no block-FP8 release of this family (its release is "
                         f"{family.release_format or 'BF16'})")
    config = json.loads(json.dumps(family.config))
    text = _text_keys(family, config)
    if int(overrides.get(NEXTN_COUNT_KEY, text.get(NEXTN_COUNT_KEY, 0)) or 0):
        raise QuantError(f"toy {family.name}: no MTP layout for this family ({NEXTN_COUNT_KEY} must be 0)")
    text.update({"vocab_size": VOCAB_SIZE, **_tokenizer_ids(), **{k: v for k, v in text.items() if k == "vocab_size"},
                 **overrides})
    tensors, config_json = layout_checkpoint(family.layout, config, family.text_config_key, seed)
    _perturb(tensors, family.perturb, torch.Generator().manual_seed(seed + 1))
    fmt = source_format or family.release_format
    if fmt:
        tensors, config_json["quantization_config"] = _in_source_format(tensors, config_json, fmt)
        if fmt == family.release_format and family.release_ignore:
            config_json["quantization_config"]["ignore"] = list(family.release_ignore)
    _write_files(family, directory, tensors, config_json, max_shard_size)


def _write_files(family: ToyFamily, directory: Path, tensors: dict, config_json: dict,
                 max_shard_size: int | None, side_file: tuple[str, dict] | None = None) -> None:
    """A toy's files: the shards (and a file of the release's own beside them), config.json, generation config,
    tokenizer and the release's side files."""
    write_safetensors(tensors, directory, max_shard_size)
    if side_file:
        _write_side_file(directory, *side_file)
    (directory / "config.json").write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    _write_generation_config(directory, config_json)
    save_toy_tokenizer(directory)
    for name, content in (family.release_files or {}).items():
        (directory / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")


def _text_keys(family: ToyFamily, kwargs: dict) -> dict:
    """The dict holding the language model's keys: the config itself, or its text_config for wrappers."""
    return kwargs[family.text_config_key] if family.text_config_key else kwargs


def _model_config(family: ToyFamily, overrides: dict):
    """The transformers config to build (main layers + MTP layers as extra decoder layers)."""

    import transformers

    text_defaults = {"vocab_size": VOCAB_SIZE, "tie_word_embeddings": False, **_tokenizer_ids()}
    kwargs = copy.deepcopy(family.config)
    if family.text_config_key:
        kwargs[family.text_config_key] = {**text_defaults, **kwargs.get(family.text_config_key, {}), **overrides}
        kwargs.setdefault("tie_word_embeddings", False)
    else:
        kwargs = {**text_defaults, **kwargs, **overrides}
    text = _text_keys(family, kwargs)
    # The family's count key sets the number of MTP layers; the NextN key is accepted for every toy (and refused
    # where the toy writes none)
    count_key = family.mtp.count_key if family.mtp else NEXTN_COUNT_KEY
    n_mtp = int(text.pop(count_key, text.pop(NEXTN_COUNT_KEY, family.mtp_layers)))
    if n_mtp and family.mtp is None:
        raise QuantError(f"toy {family.name}: no MTP layout for this family ({NEXTN_COUNT_KEY} must be 0)")
    if text["vocab_size"] < VOCAB_SIZE:
        raise QuantError(f"toy {family.name}: vocab_size {text['vocab_size']} is smaller than the toy tokenizer "
                         f"({VOCAB_SIZE} tokens)")
    n_main = int(text["num_hidden_layers"])
    text["num_hidden_layers"] = n_main + n_mtp
    if n_mtp and family.mtp.layer_type and isinstance(text.get("layer_types"), list):
        text["layer_types"] = list(text["layer_types"]) + [family.mtp.layer_type] * n_mtp
        if isinstance(text.get("mlp_layer_types"), list):  # the MTP block is a routed-MoE block
            text["mlp_layer_types"] = list(text["mlp_layer_types"]) + [family.mtp.mlp_layer_type] * n_mtp
    if not family.text_config_key and "num_mtp_layers" in _config_parameters(family.config_class):
        # DeepseekV3Config aliases num_mtp_layers to num_nextn_predict_layers and defaults it to 1.
        kwargs["num_mtp_layers"] = n_mtp
    try:
        return getattr(transformers, family.config_class)(**kwargs), n_main, n_mtp
    except (TypeError, ValueError) as e:
        raise QuantError(f"toy {family.name}: invalid config overrides ({e})") from e


def _config_parameters(config_class: str) -> set[str]:
    import transformers

    return set(inspect.signature(getattr(transformers, config_class).__init__).parameters)


@cache
def _tokenizer_ids() -> dict[str, int]:
    tokenizer = toy_tokenizer()
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    return {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": tokenizer.convert_tokens_to_ids(PAD_TOKEN)}


def _transformers_checkpoint(family: ToyFamily, config, *, seed: int, fused_experts: bool,
                             mtp_fused_experts: bool, n_main: int, n_mtp: int):
    """Tensors and config.json exactly as transformers writes them for a seeded random model; the decoder
    layers built for the MTP blocks are moved to the family's MTP names (in their own expert layout)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if family.model_class:
            model = getattr(transformers, family.model_class)._from_config(config, dtype=torch.bfloat16)
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tensors, config_json = _saved(model, fused_experts, family.renames)
    if not n_mtp:
        return tensors, config_json
    mtp_source = tensors if mtp_fused_experts == fused_experts else _saved(model, mtp_fused_experts,
                                                                           family.renames)[0]
    text = family.text_prefix
    for k in range(n_mtp):
        built = f"{text}layers.{n_main + k}."
        target = family.mtp.layer_prefix.format(text=text, n=n_main + k, k=k)
        block = {target + name[len(built):]: value for name, value in mtp_source.items() if name.startswith(built)
                 and not any(p.search(name[len(built):]) for p in family.mtp.drop)}
        for name in [n for n in tensors if n.startswith(built)]:
            del tensors[name]
        tensors.update(block)
    return tensors, config_json


def _cpu_independent_numerics():
    """A context in which float32/bf16 random draws (randn, rand, normal_, uniform_) and exp, log, expm1, log1p are
    computed in float64 and rounded: the toy is then the same bytes on every CPU and under every ATEN_CPU_CAPABILITY.

    ATen's float32 normal_ and uniform_ (bf16's go through them) are vectorised per ISA and round differently under
    avx2 and default, and its float32 exp/log go through MKL's vector math, whose last bit follows the CPU (an Intel
    Xeon and an AMD EPYC gave different GLM-5.3-Flash toys: transformers initialises dt_bias as log(-expm1(-exp(u)))
    of a uniform u). float64 draws are one scalar rule and a float64 result rounded to float32 does not depend on
    the last bit. Intercepted at the dispatcher (aten ops), so nn.init's wrappers are covered too."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    reduced = (torch.float32, torch.bfloat16, torch.float16)
    draws = {aten.normal_, aten.uniform_}
    factories = {aten.randn, aten.rand}
    functions = {aten.exp: aten.exp, aten.log: aten.log, aten.expm1: aten.expm1, aten.log1p: aten.log1p,
                 aten.exp_: aten.exp, aten.log_: aten.log, aten.expm1_: aten.expm1, aten.log1p_: aten.log1p}

    class Float64Numerics(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            packet = func.overloadpacket
            if packet in factories and kwargs.get("dtype", torch.get_default_dtype()) in reduced:
                return func(*args, **{**kwargs, "dtype": torch.float64}).to(kwargs.get("dtype",
                                                                                   torch.get_default_dtype()))
            x = args[0] if args else None
            if not isinstance(x, torch.Tensor) or x.dtype not in reduced or x.device.type != "cpu":
                return func(*args, **kwargs)
            if packet in draws:
                value = torch.empty(x.shape, dtype=torch.float64)
                func(value, *args[1:], **kwargs)
                return x.copy_(value)
            if packet in functions and len(args) == 1 and not kwargs:
                value = functions[packet].default(x.to(torch.float64)).to(x.dtype)
                return x.copy_(value) if packet is not functions[packet] else value
            return func(*args, **kwargs)

    return Float64Numerics()


def _saved(model, fused_experts: bool, renames=()) -> tuple[dict, dict]:
    from safetensors.torch import load_file
    from transformers.utils import logging as hf_logging

    progress_bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            # save_original_format=True reverts the in-memory fused experts to per-expert 2-D tensors.
            model.save_pretrained(tmp, save_original_format=not fused_experts)
            tensors = {}
            for shard in sorted(Path(tmp).glob("*.safetensors")):
                tensors.update(load_file(shard))
            config_json = json.loads((Path(tmp) / "config.json").read_text())
    finally:
        if progress_bars:
            hf_logging.enable_progress_bar()
    for pattern, replacement in renames:
        tensors = {pattern.sub(replacement, name): value for name, value in tensors.items()}
    return tensors, config_json


def _mtp_extras(family: ToyFamily, tensors: dict, config_json: dict, n_main: int, n_mtp: int, generator) -> dict:
    """The tensors an MTP layer has besides its decoder block (enorm, hnorm, eh_proj, shared_head, mtp.fc...)."""
    import torch

    if family.mtp is None:
        return {}
    text = config_json.get(family.text_config_key, config_json) if family.text_config_key else config_json
    hidden = text["hidden_size"]
    std = text.get("initializer_range", 0.02)
    extras = {}
    for k in range(n_mtp):
        prefix = family.mtp.extras_prefix.format(text=family.text_prefix, n=n_main + k, k=k)
        for leaf, kind in family.mtp.extras.items():
            if kind in ("ones", "zeros"):  # zeros: Gemma-style norms that scale by (1 + weight), as Qwen3.5's
                value = (torch.ones if kind == "ones" else torch.zeros)(hidden, dtype=torch.bfloat16)
            elif kind == "square":  # DeepSeek-V4's MTP e_proj / h_proj: [H, H]
                value = (torch.randn(hidden, hidden, generator=generator) * std).to(torch.bfloat16)
            elif kind == "projection":  # eh_proj / fc: [H, 2H] over concat(norm(embedding), norm(hidden state))
                value = (torch.randn(hidden, 2 * hidden, generator=generator) * std).to(torch.bfloat16)
            else:
                value = tensors[kind.removeprefix("copy:")].clone()
            extras[prefix + leaf] = value
    return extras


def _natural_key(name: str) -> list:
    # "layers.10" after "layers.9"; re.split keeps text at even and digits at odd positions, so types line up.
    return [int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", name))]


def _natural_order(tensors: dict) -> dict:
    return {name: tensors[name] for name in sorted(tensors, key=_natural_key)}


def _cast_f32(tensors: dict, patterns: tuple[re.Pattern, ...]) -> None:
    import torch

    for name, value in tensors.items():
        if any(p.search(name) for p in patterns):
            tensors[name] = value.to(torch.float32)


def _perturb(tensors: dict, perturb: dict[str, float], generator) -> None:
    import torch

    patterns = [(re.compile(p), std) for p, std in perturb.items()]
    for name, value in tensors.items():
        std = next((s for p, s in patterns if p.search(name)), None)
        if std is not None:
            noise = torch.randn(value.shape, generator=generator) * std
            tensors[name] = (value.float() + noise).to(value.dtype)


def _release_config_json(family: ToyFamily, config_json: dict, n_main: int, n_mtp: int) -> dict:
    """config.json as the real release writes it: MTP layers counted apart, release-only keys (those that
    select code paths in vLLM/SGLang but that transformers' config class does not write), key spellings."""

    config_json = copy.deepcopy(config_json)
    text = config_json[family.text_config_key] if family.text_config_key else config_json
    text["num_hidden_layers"] = n_main
    for key in PER_LAYER_CONFIG_KEYS:
        if isinstance(text.get(key), list):
            text[key] = text[key][:n_main]
    if family.mtp is not None:
        text.pop("num_mtp_layers", None)
        text[family.mtp.count_key] = n_mtp
    for old, new in family.config_json_renames.items():
        if old in text:
            text[new] = text.pop(old)
    return merge_into(config_json, copy.deepcopy(family.release_config))


def _quantize_fp8_block(tensors: dict, release: Fp8Release) -> dict:
    from quant.numerics.fp8 import quantize_fp8_block

    out = {}
    for name, value in tensors.items():
        if release.quantizes(name):
            weight, scale_inv = quantize_fp8_block(value)
            out[name] = weight
            out[name + "_scale_inv"] = scale_inv
        else:
            out[name] = value
    return out


def _microscale(tensors: dict, native: dict) -> dict:
    """The release's own storage (the toy's `native`): `mxfp4` weights as int8 E2M1 pairs + E8M0 `.scale` per
    32 inputs, `fp8_ue8m0` weights as float8_e4m3fn + E8M0 `.scale` per 128x128 block, `bf16_tensors` cast to
    BF16; the scale rules are the release's, not this tool's (quant.sources' formats)."""
    import torch


    mx = [re.compile(p) for p in native.get("mxfp4", [])]
    fp8 = [re.compile(p) for p in native.get("fp8_ue8m0", [])]
    bf16 = [re.compile(p) for p in native.get("bf16_tensors", [])]
    out = {}
    for name, value in tensors.items():
        encoding = "mxfp4" if any(p.search(name) for p in mx) else "fp8-ue8m0" if any(p.search(name) for p in fp8) \
            else None
        if name.endswith(".weight") and encoding is not None:
            module = name[: -len(".weight")]
            for suffix, part in encode_as(encoding, value, native.get("fp8_block", 128)).items():
                out[module + suffix] = part
        elif any(p.search(name) for p in bf16):
            out[name] = value.to(torch.bfloat16)
        else:
            out[name] = value
    return out


def source_formats() -> dict:
    """manifests/source_formats.yaml `formats`: the release storage formats a toy can be written in (read strictly,
    with the source formats they encode in, by quant.sources.registry)."""

    return release_storages()


def source_format_spec(name: str | None) -> dict | None:
    """The spec of source format `name` (None: none asked); QuantError listing the valid names otherwise."""
    if name is None:
        return None
    formats = source_formats()
    if name not in formats:
        raise QuantError(f"unknown source format {name!r}; valid names: {', '.join(formats)}")
    return formats[name]


def _in_source_format(tensors: dict, config_json: dict, name: str) -> tuple[dict, dict]:
    """The toy's tensors stored as the release of source format `name` stores them (manifests/source_formats.yaml):
    each 2-D linear weight of the listed roles encoded (quant.sources.registry.encode_as), the others listed as
    kept; and the release's quantization_config."""

    spec = source_format_spec(name)
    if config_json.get("quantization_config"):
        raise QuantError(f"--source-format {name} writes a BF16 toy's weights in another format; this toy is already "
                         f"quantized (--fp8-block or a microscaled release)")
    family = family_for_config(config_json)
    roles = spec["roles"] if isinstance(spec["roles"], dict) else dict.fromkeys(spec["roles"], spec.get("encode"))
    out, kept = {}, []
    for tensor, value in tensors.items():
        module = tensor[: -len(".weight")] if tensor.endswith(".weight") else None
        if module is None or value.dim() != 2 or "embed" in module or value.shape[-1] % 32:
            out[tensor] = value
            continue
        role = family.role_of(module)
        if role in roles:
            for suffix, part in encode_as(roles[role], value, spec.get("fp8_block", 128)).items():
                out[module + suffix] = part
        else:
            out[tensor] = value
            kept.append(module)
    config = json.loads(json.dumps(spec["quantization_config"]))
    if spec.get("ignore_key"):
        config[spec["ignore_key"]] = list(spec.get("ignore_extra") or []) + sorted(kept)
    return out, config


def _quantization_config(release: Fp8Release, tensors: dict, n_layers: int) -> dict:
    config = {**_manifest()["quantization_config"], **release.quantization_config}
    modules = []
    for entry in release.modules_to_not_convert:
        modules += [entry.format(i=i) for i in range(n_layers)] if "{i}" in entry else [entry]
    if not release.keep_unmatched_modules:
        modules = [m for m in modules if any(name.startswith(m + ".") for name in tensors)]
    if modules:
        config["modules_to_not_convert"] = modules
    return config


def write_safetensors(tensors: dict, directory: Path, max_shard_size: int | None) -> list[str]:
    """Write `tensors` (in their order) as `model.safetensors` or `model-0000k-of-0000n.safetensors` shards
    of at most `max_shard_size` bytes (a larger tensor gets a shard of its own) plus the index. Returns the
    shard file names."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save

    # Own, exactly-sized storage per tensor: the splitter sizes and groups tensors by storage.
    tensors = {k: v.detach().clone(memory_format=torch.contiguous_format) for k, v in tensors.items()}
    total_size = sum(v.numel() * v.element_size() for v in tensors.values())
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size or total_size + 1)
    for filename, names in split.filename_to_tensors.items():
        # save() + write_bytes rather than save_file, which creates owner-only files.
        (directory / filename).write_bytes(save({n: tensors[n] for n in names}, metadata={"format": "pt"}))
    if split.is_sharded:
        index = {"metadata": {"total_size": total_size}, "weight_map": split.tensor_to_filename}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return list(split.filename_to_tensors)


def _write_side_file(directory: Path, name: str, tensors: dict) -> None:
    """A safetensors file the release ships beside its shards (MiniMax-M3.1's DSpark draft), listed in the index
    (written here for a single-shard toy): SGLang 0.5.23 reads only the index's files when there is one
    (model_loader/weight_utils.py:807), and a sharded release has one."""
    from safetensors.torch import save

    from quant.safetensors_header import read_header

    (directory / name).write_bytes(save({k: v.contiguous() for k, v in tensors.items()}, metadata={"format": "pt"}))
    index_path = directory / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:
        main, _, offsets = read_header(directory / "model.safetensors")
        index = {"metadata": {"total_size": sum(e - b for b, e in offsets.values())},
                 "weight_map": dict.fromkeys(main, "model.safetensors")}
    index["metadata"]["total_size"] += sum(v.numel() * v.element_size() for v in tensors.values())
    index["weight_map"].update(dict.fromkeys(tensors, name))
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _write_generation_config(directory: Path, config_json: dict) -> None:
    from transformers import GenerationConfig


    config_json = text_config(config_json)
    GenerationConfig(
        bos_token_id=config_json["bos_token_id"],
        eos_token_id=config_json["eos_token_id"],
        pad_token_id=config_json["pad_token_id"],
    ).save_pretrained(directory)
