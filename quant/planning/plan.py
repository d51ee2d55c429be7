"""Planning: decide, from headers and config alone, what happens to every source tensor.

The plan is complete before any tensor data is read, so every bad input that headers can reveal (missing
scales, odd shapes, unknown dtypes, a config without the fields the recipe needs) fails before anything is
written. One output shard per source shard keeps peak memory near one shard and makes resuming per shard.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from dataclasses import asdict, dataclass, field

from quant import __version__
from quant.checkpoint import FLOAT_DTYPES, SCALE_INV, Checkpoint, Source
from quant.families import Family, mtp_layout, text_config
from quant.families.sidecars import sidecar_files, sidecar_pattern
from quant.errors import QuantError
from quant.planning.recipes import Recipe
from quant.planning.schemes import Scheme
from quant.planning.treatment import ModuleTreatment, layer_of
from quant.sources import native
from quant.sources.block_fp8 import BLOCK_FP8
from quant.sources.registry import format_named

FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<param>[a-z_]+)$")


@dataclass(frozen=True)
class TensorJob:
    """One output module or tensor. `action`: copy (as stored), dequantize (block-FP8 or microscaled source kept
    in BF16), quantize (to `scheme`), passthrough (a microscaled source whose target is its own format: codes and
    scales carried over bit for bit, quant.sources.native.passes_through)."""

    output: str  # output tensor name (copy/dequantize) or module name (quantize: module.weight, ...)
    action: str
    source: Source
    role: str | None = None
    scheme: str | None = None


@dataclass
class ShardJob:
    file: str  # output shard file name
    source_file: str
    source_bytes: int
    jobs: list[TensorJob] = field(default_factory=list)


@dataclass
class Plan:
    family: str
    recipe: dict
    scheme: Scheme
    scale_mode: str
    source_format: str  # "bf16", "fp8-block" or "microscaled" (quant.sources: MXFP4 / UE8M0 FP8 / MXFP8 / NVFP4)
    shards: list[ShardJob]
    kept_modules: list[str]  # 2-D weights left unquantized: the exclusion manifest
    quantized: dict[str, str]  # module -> scheme name
    mtp_layers: list[int]
    settings: dict
    recipe_path: Path | None = None  # a user's recipe file (saved beside the model card), None for built-ins
    # module -> parameter count of every linear some recipe could quantize (the effective bits' denominator)
    linear_params: dict[str, int] = field(default_factory=dict)

    def digest(self) -> str:
        """Identifies the output: equal digests mean byte-identical output shards."""
        payload = {"settings": self.settings, "recipe": self.recipe,
                   "shards": [[s.file, s.source_file, s.source_bytes,
                               [asdict(j) for j in s.jobs]] for s in self.shards]}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def source_format(ckpt: Checkpoint) -> str:
    if native.is_microscaled(ckpt):
        native.check_config(ckpt.quantization_config, ckpt.root / "config.json")
        return native.MICROSCALED
    qc = ckpt.quantization_config
    if not qc:
        return "bf16"
    method = qc.get("quant_method")
    if format_named(BLOCK_FP8).declared_by(qc, ckpt.root / "config.json"):
        return BLOCK_FP8
    raise QuantError(f"{ckpt.root / 'config.json'}: source is already quantized "
                     f"(quantization_config.quant_method={method!r}); start from a BF16, block-FP8 or microscaled "
                     f"checkpoint (README: Microscaled sources)")


class Planner:
    def __init__(self, ckpt: Checkpoint, family: Family, recipe: Recipe, scheme: Scheme, scale_mode: str):
        self.ckpt, self.family, self.recipe, self.scheme = ckpt, family, recipe, scheme
        self.scale_mode = scale_mode
        self.config = text_config(ckpt.config)
        # MTP layers stored in the decoder stack (model.layers.{N + k}); a namespaced MTP head (Qwen3.5 mtp.*) is
        # planned by its family's roles
        self.mtp = mtp_layout(self.config, family)
        self.mtp_layers = list(self.mtp.decoder_layers)
        # (role, scheme) of a module: the rule `quant quantize --dry-run` asks too
        self.treatment = ModuleTreatment(family, recipe, scheme, self.mtp)
        self.format = source_format(ckpt)
        self.kept: list[str] = []
        self.quantized: dict[str, str] = {}
        self.linear_params: dict[str, int] = {}
        self.scales = native.scale_tensors(ckpt.tensors) if self.format == native.MICROSCALED else set()
        # Sidecar tensors (the family's `sidecars`: Engram tables) are carried over as stored, bytes unchanged:
        # they are no linear any scheme applies to, and the engine loads them in their release dtype.
        self.sidecar = sidecar_pattern(family.sidecars)

    def check_weight(self, name: str, dtype: str, shape: tuple[int, ...], scheme: Scheme | None) -> None:
        where = f"{self.ckpt.root / self.ckpt.tensors[name].file}: tensor {name}"
        if dtype not in FLOAT_DTYPES and dtype != "F8_E4M3":
            raise QuantError(f"{where} has dtype {dtype}, expected BF16, F16, F32 or F8_E4M3")
        if scheme is not None and 0 in shape:
            raise QuantError(f"{where} has shape {list(shape)}: an empty weight cannot be quantized")
        if scheme is not None and shape[-1] % scheme.k_multiple:
            raise QuantError(f"{where} has input dim {shape[-1]}, not a multiple of {scheme.k_multiple} "
                             f"({scheme.name} blocks run along the input dim); keep it BF16 with a recipe")

    def scale_inv_of(self, name: str) -> tuple[str | None, str | None]:
        """A block-FP8 weight's tile scales and their file (None, None: a weight of another dtype)."""
        where = str(self.ckpt.root / self.ckpt.tensors[name].file)
        encoding = format_named(BLOCK_FP8).recognise(self.ckpt.tensors, name, where)
        if encoding is None:
            return None, None
        return encoding.scale, self.ckpt.tensors[encoding.scale].file

    def add_weight(self, jobs: list[TensorJob], module: str, source: Source, dtype: str,
                   shape: tuple[int, ...]) -> None:
        role, scheme = self.treatment(module)
        self.check_weight(source.name, dtype, shape, scheme)
        self.count_linear(module, shape)
        if scheme is None:
            self.kept.append(module)
            action = "dequantize" if source.scale_inv else "copy"
            jobs.append(TensorJob(module + ".weight", action, source, role))
        else:
            self.quantized[module] = scheme.name
            jobs.append(TensorJob(module, "quantize", source, role, scheme.name))

    def count_linear(self, module: str, shape: tuple[int, ...]) -> None:
        if len(shape) == 2 and self.treatment.recipe_can_quantize(module):
            self.linear_params[module] = shape[0] * shape[1]

    def keep_sidecar_linears(self, files: set[str]) -> None:
        """A sidecar file's 2-D weights join the kept modules, so the export's exclude names them: an engine builds
        the draft with the target's quantization_config (SGLang 0.5.23 configs/minimax_vl.py:110) and would make
        a BF16 draft linear quantized, which its BF16 weight cannot load into."""
        shapes = {t.name: tuple(t.shape) for t in self.ckpt.tensors.values() if t.file in files}
        for file in sorted(files):  # a draft file the source's index leaves out: its own header says what it holds
            if file not in self.ckpt.files and self.ckpt.has_file(file):
                try:
                    shapes.update({n: tuple(shape) for n, (_, shape) in self.ckpt.file_header(file).items()})
                except (OSError, ValueError) as e:
                    raise QuantError(f"{self.ckpt.root / file}: cannot read its header ({e})") from None
        for name in sorted(shapes):
            if name.endswith(".weight") and len(shapes[name]) == 2:
                self.kept.append(name[: -len(".weight")])

    def add_native(self, jobs: list[TensorJob], name: str, info, encoding) -> None:
        """A microscaled weight: passthrough when its target is its own format, else decoded exactly once (kept
        BF16: dequantize; another scheme: quantize)."""
        module = encoding.module
        if len(encoding.shape) != 2:
            raise QuantError(f"{self.ckpt.root / info.file}: tensor {name} is a {len(encoding.shape)}-D "
                             f"{encoding.kind} tensor; only 2-D microscaled weights are supported")
        role, scheme = self.treatment(module)
        self.check_weight(name, "F32", encoding.shape, scheme)
        self.count_linear(module, encoding.shape)
        source = native.native_source(self.ckpt, name, encoding)
        if scheme is None:
            self.kept.append(module)
            jobs.append(TensorJob(module + ".weight", "dequantize", source, role))
            return
        self.quantized[module] = scheme.name
        action = "passthrough" if native.passes_through(encoding, scheme.name) else "quantize"
        jobs.append(TensorJob(module, action, source, role, scheme.name))

    def split_fused(self, jobs: list[TensorJob], name: str, info) -> bool:
        m = FUSED_EXPERTS.match(name)
        fused = (self.family.fused_experts or {}).get(m.group("param")) if m else None
        if fused is None or len(info.shape) != 3:
            return False
        experts, rows, _ = info.shape
        parts = fused.parts
        if rows % len(parts):
            raise QuantError(f"{self.ckpt.root / info.file}: tensor {name} has {rows} rows, "
                             f"not divisible into {', '.join(parts)}")
        if info.dtype == "F8_E4M3":
            raise QuantError(f"{self.ckpt.root / info.file}: tensor {name} is a fused F8_E4M3 expert tensor; "
                             f"only BF16/F16/F32 fused experts can be split")
        step = rows // len(parts)
        for e in range(experts):
            for i, part in enumerate(parts):
                src = Source(name, info.file, expert=e, rows=(i * step, (i + 1) * step))
                self.add_weight(jobs, f"{m.group('prefix')}.{e}.{part}", src, info.dtype, (step, info.shape[2]))
        return True

    def shard_jobs(self, file: str) -> list[TensorJob]:
        jobs: list[TensorJob] = []
        for info in sorted(self.ckpt.shard_tensors(file), key=lambda t: t.name):
            name = info.name
            if self.sidecar is not None and self.sidecar.match(name):
                jobs.append(TensorJob(name, "copy", Source(name, info.file), "sidecar"))
                continue
            if name.endswith(SCALE_INV) and self.format == BLOCK_FP8:
                if name[: -len(SCALE_INV)] not in self.ckpt.tensors:
                    raise QuantError(f"{self.ckpt.root / info.file}: tensor {name} has no matching weight")
                continue  # consumed with its weight
            if name in self.scales:
                continue  # a microscaled weight's scales (and NVFP4's global scales): consumed with its weight
            encoding = native.recognise(self.ckpt.tensors, name, str(self.ckpt.root / info.file)) \
                if self.scales else None
            if encoding is not None:
                self.add_native(jobs, name, info, encoding)
                continue
            if self.split_fused(jobs, name, info):
                continue
            if name.endswith(".weight") and len(info.shape) == 2:
                scale_inv, scale_file = self.scale_inv_of(name)
                self.add_weight(jobs, name[: -len(".weight")], Source(name, info.file, scale_inv, scale_file),
                                info.dtype, info.shape)
                continue
            if info.dtype == "F8_E4M3":
                raise QuantError(f"{self.ckpt.root / info.file}: tensor {name} is F8_E4M3 but is not a 2-D weight")
            scale = native.missing_scale(self.ckpt.tensors, name)
            if scale is not None:
                raise QuantError(f"{self.ckpt.root / info.file}: tensor {name} holds packed FP4 codes but {scale} "
                                 f"is missing: it cannot be decoded (re-copy the source shard that holds it)")
            jobs.append(TensorJob(name, "copy", Source(name, info.file)))
        return jobs


def make_plan(ckpt: Checkpoint, family: Family, recipe: Recipe, scheme: Scheme, scale_mode: str) -> Plan:
    ckpt.require_intact()
    planner = Planner(ckpt, family, recipe, scheme, scale_mode)
    for layer in planner.mtp_layers:
        if not any(layer_of(n) == layer for n in ckpt.tensors):
            raise QuantError(f"{ckpt.root / 'config.json'}: declares MTP layer model.layers.{layer} "
                             f"({planner.mtp.count_key}) but no tensor of that layer is stored")
    # A sidecar file (MiniMax-M3.1's DSpark draft) is copied byte for byte beside the shards (quant/pipeline/
    # sidecars.py), never planned as one: none of its tensors is quantized or written twice.
    side = sidecar_files(family.sidecars, planner.config)
    planner.keep_sidecar_linears(side)
    files = [f for f in ckpt.files if f not in side]
    n = len(files)
    shards = []
    for i, file in enumerate(files):
        out = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        shards.append(ShardJob(out, file, ckpt.file_size(file), planner.shard_jobs(file)))
    settings = {"tool": "moe-quant", "version": __version__, "scheme": scheme.name, "scale_mode": scale_mode,
                "family": family.name, "source_format": planner.format}
    return Plan(family=family.name, recipe=recipe.to_dict(), scheme=scheme, scale_mode=scale_mode,
                source_format=planner.format, shards=shards, kept_modules=planner.kept,
                quantized=planner.quantized, mtp_layers=planner.mtp_layers, settings=settings,
                linear_params=planner.linear_params)
