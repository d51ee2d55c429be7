"""A Hugging Face safetensors checkpoint directory, read through its config, index and shard headers.

Opening a checkpoint never reads tensor data: the safetensors library parses each shard's header (and checks
that offsets and sizes fit the file), so this runs in seconds on a terabyte checkpoint. Integrity problems
(index vs headers, missing files, names escaping the directory) are collected as `Problem`s; callers decide
whether they are fatal (`require_intact`) or findings to report (verify-manifest). Tensor data is read only when
asked: a `Source` names one tensor (or a slice of a fused expert tensor, or a block-FP8 weight with its scales)
and a `SourceReader` reads it (the quantize pipeline's shards, the decoder layers quant.model_exec builds).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from safetensors import safe_open

from quant.errors import QuantError, UnreadableCheckpoint
from quant.families import text_config
from quant.families.mtp import COUNT_KEYS as MTP_COUNT_KEYS  # every family's MTP count key
from quant.families.shapes import LM_LAYER
from quant.safetensors_header import read_header

if TYPE_CHECKING:
    import torch

__all__ = ["Checkpoint", "TensorInfo", "Problem", "open_checkpoint", "build_checkpoint", "load_tensors", "read_json",
           "text_config", "validate_config", "lm_layer_indices", "safetensors_dtype"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# torch is imported lazily: the preflight reads only headers and must not pay torch's import time.
TORCH_DTYPE_NAMES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
                     "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
                     "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu"}
FLOAT_DTYPES = ("BF16", "F16", "F32")
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "I32": 4, "I64": 8, "F16": 2, "BF16": 2, "F32": 4,
               "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "U32": 4, "U64": 8}


def safetensors_dtype(dtype) -> str:
    """The safetensors dtype string of a torch dtype ("BF16" for torch.bfloat16)."""
    for name, torch_name in TORCH_DTYPE_NAMES.items():
        if str(dtype) == f"torch.{torch_name}":
            return name
    raise QuantError(f"no safetensors name for torch dtype {dtype}")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str  # shard file name, relative to the checkpoint directory
    dtype: str  # safetensors dtype string: "BF16", "U8", "F8_E4M3", ...
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES.get(self.dtype, 1)


# Integrity problems that leave the checkpoint unreadable (exit 2) rather than loadable with wrong or missing
# tensors (exit 1).
UNREADABLE_PROBLEMS = ("missing-file", "unsafe-path", "corrupt-shard")


@dataclass(frozen=True)
class Problem:
    """An integrity problem: `kind` is one of missing-file, unsafe-path, missing-tensor, extra-tensor,
    duplicate-tensor, corrupt-shard."""

    kind: str
    file: str
    tensor: str | None
    message: str


@dataclass
class Checkpoint:
    root: Path
    config: dict
    tensors: dict[str, TensorInfo]
    files: list[str]
    index: dict | None
    problems: list[Problem] = field(default_factory=list)

    @property
    def quantization_config(self) -> dict | None:
        return self.config.get("quantization_config")

    def require_intact(self) -> None:
        """Raise the first integrity problem: UnreadableCheckpoint (exit 2) for a shard that is missing, outside
        the directory or unreadable, QuantError (exit 1) for tensors the index and the headers disagree on."""
        for problem in sorted(self.problems, key=lambda p: p.kind not in UNREADABLE_PROBLEMS):
            error = UnreadableCheckpoint if problem.kind in UNREADABLE_PROBLEMS else QuantError
            raise error(problem.message)

    def shard_tensors(self, file: str) -> list[TensorInfo]:
        return [t for t in self.tensors.values() if t.file == file]

    def shard_path(self, file: str) -> Path:
        return self.root / file

    def file_size(self, file: str) -> int:
        """The size of shard `file` in bytes (the plan records it; a Hub checkpoint knows it without the file)."""
        return (self.root / file).stat().st_size

    def total_bytes(self) -> int:
        return sum((self.root / f).stat().st_size for f in self.files if (self.root / f).is_file())

    def has_file(self, name: str) -> bool:
        """Whether the checkpoint holds file `name` (a path relative to its root); a Hub checkpoint answers from the
        repository's file list, without fetching anything."""
        return (self.root / name).is_file()

    def file_header(self, name: str) -> dict:
        """{tensor: (dtype, shape)} from the header of safetensors file `name`, one the index may not list (a draft
        file beside the shards). ValueError or OSError when it cannot be read."""

        return read_header(self.root / name)[0]


def is_safe_relative(name: str) -> bool:
    """A file name from an index that stays inside the checkpoint directory."""
    p = PurePosixPath(name.replace("\\", "/"))
    return bool(name) and not p.is_absolute() and ".." not in p.parts and not name.startswith("~")


def read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise UnreadableCheckpoint(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UnreadableCheckpoint(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise UnreadableCheckpoint(f"{path}: expected a JSON object")
    return data


def read_shard_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor in one shard, from its header only."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    # framework="numpy" reads the same header without importing torch; no tensor is materialized.
    with safe_open(str(path), framework="numpy") as f:
        for name in f.keys():
            sl = f.get_slice(name)
            out[name] = (sl.get_dtype(), tuple(sl.get_shape()))
    return out


def open_checkpoint(path: str | Path, metadata_dir: str | Path | None = None) -> Checkpoint:
    """Read config.json, the index and every shard header. Raises UnreadableCheckpoint when there is no
    checkpoint to speak of; collects every other integrity problem in `Checkpoint.problems`. `metadata_dir`
    reads config.json and the index from elsewhere (the quantizer checks its staged files before publishing
    them beside the shards)."""
    root = Path(path)
    if not root.is_dir():
        raise UnreadableCheckpoint(f"{root}: not a checkpoint directory")
    meta = Path(metadata_dir) if metadata_dir is not None else root
    config = read_json(meta / "config.json")
    index = read_json(meta / INDEX_FILE) if (meta / INDEX_FILE).exists() else None
    files = None
    if index is None:
        if (root / SINGLE_FILE).exists():
            files = [SINGLE_FILE]
        else:
            files = sorted(p.name for p in root.glob("*.safetensors"))
            if not files:
                raise UnreadableCheckpoint(f"{root}: no {INDEX_FILE} and no *.safetensors files")

    def header(file: str):
        fpath = root / file
        return read_shard_header(fpath) if fpath.is_file() else None

    return build_checkpoint(root, meta, config, index, files, header)


def build_checkpoint(root, meta, config: dict, index: dict | None, files: list[str] | None, read_header) -> Checkpoint:
    """The Checkpoint of `config` and `index` (None: no index; then the shards are `files`), each shard's header
    from `read_header(file)`: name -> (dtype, shape), None for a missing file, an exception for an unreadable
    one. `root` and `meta` (where the shards and config.json / the index live) only name things in messages and
    become `Checkpoint.root`: a directory here, a Hub repository in quant.hub, which reads the same headers over
    HTTP and so finds the same problems."""
    problems: list[Problem] = []
    expected: dict[str, str] = {}  # tensor -> file, from the index
    if index is not None:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise UnreadableCheckpoint(f"{meta / INDEX_FILE}: no 'weight_map' object")
        expected = {str(k): str(v) for k, v in weight_map.items()}
        files = sorted(set(expected.values()))

    tensors: dict[str, TensorInfo] = {}
    readable: list[str] = []
    for file in files:
        if not is_safe_relative(file):
            problems.append(Problem("unsafe-path", file, None,
                                    f"{root / INDEX_FILE}: file name '{file}' escapes the checkpoint directory"))
            continue
        fpath = root / file
        try:
            header = read_header(file)
        except Exception as e:  # safetensors raises its own error type for corrupt/truncated headers
            problems.append(Problem("corrupt-shard", file, None,
                                    f"{fpath}: unreadable safetensors file ({str(e).splitlines()[0]})"))
            continue
        if header is None:
            first = next((t for t, f in expected.items() if f == file), None)
            problems.append(Problem("missing-file", file, first,
                                    f"{fpath}: listed in the index (e.g. for {first}) but missing"))
            continue
        readable.append(file)
        for name, (dtype, shape) in header.items():
            if name in tensors:
                problems.append(Problem("duplicate-tensor", file, name,
                                        f"{fpath}: tensor {name} also stored in {tensors[name].file}"))
                continue
            tensors[name] = TensorInfo(name, file, dtype, shape)

    if index is not None:
        for name, file in expected.items():
            if file in readable and (name not in tensors or tensors[name].file != file):
                problems.append(Problem("missing-tensor", file, name,
                                        f"{root / file}: index lists tensor {name} but the shard does not hold it"))
        for name, info in tensors.items():
            if name not in expected:
                problems.append(Problem("extra-tensor", info.file, name,
                                        f"{root / info.file}: tensor {name} is not in {INDEX_FILE}"))
    validate_config(config, meta / "config.json", tensors)
    return Checkpoint(root=root, config=config, tensors=tensors, files=files, index=index, problems=problems)


# ------------------------------------------------------------------- config.json values (not a valid checkpoint)
# Checked when a checkpoint is opened: the "not a valid checkpoint" half of quant/validate.py (exit 2).

# key -> smallest allowed value; checked in the config and in its text_config (VL wrappers). A RoPE dimension of 0
# is a NoPE model (GLM-5.3-Flash: qk_rope_head_dim 0, and transformers' Glm5NextTextConfig sets head_dim to it).
COUNTS = {
    "num_hidden_layers": 1, "hidden_size": 1, "vocab_size": 1, "num_attention_heads": 1,
    "num_key_value_heads": 1, "head_dim": 0, "intermediate_size": 1, "moe_intermediate_size": 1,
    "shared_expert_intermediate_size": 1, "n_routed_experts": 1, "num_experts": 1, "num_local_experts": 1,
    "num_experts_per_tok": 1, "n_shared_experts": 0, "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1,
    "q_lora_rank": 1, "kv_lora_rank": 1, "qk_rope_head_dim": 0, "qk_nope_head_dim": 1, "v_head_dim": 1,
    "index_n_heads": 1, "index_head_dim": 1, **dict.fromkeys(MTP_COUNT_KEYS, 0),
}
NULLABLE = {"q_lora_rank", "head_dim", "intermediate_size", "n_shared_experts", "first_k_dense_replace", "n_group",
            "topk_group", *MTP_COUNT_KEYS}
EXPERT_COUNTS = ("n_routed_experts", "num_experts", "num_local_experts")
TENSOR_SPECS = ("input_tensors", "output_tensors", "weight", "bias")
SHOWN = 5  # examples named in a message


def _short(value) -> str:
    return f"{value!r:.40}"


# ------------------------------------------------------------------------------------- not a valid checkpoint


def _check_counts(section: dict, where: str) -> None:
    for key, least in COUNTS.items():
        if key not in section:
            continue
        value = section[key]
        if value is None and key in NULLABLE:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise UnreadableCheckpoint(f"{where}: '{key}' must be an integer, got {_short(value)}")
        if value < least:
            raise UnreadableCheckpoint(f"{where}: '{key}' must be at least {least}, got {value}")


def _check_layer_config(layer: object, where: str) -> None:
    """A Quark QLayerConfig: each tensor spec is null, an object or a list of objects (two-stage schemes)."""
    if not isinstance(layer, dict):
        raise UnreadableCheckpoint(f"{where} must be an object, got {_short(layer)}")
    for key in TENSOR_SPECS:
        spec = layer.get(key)
        specs = spec if isinstance(spec, list) else [spec]
        if not all(s is None or isinstance(s, dict) for s in specs):
            raise UnreadableCheckpoint(f"{where}.{key} must be null, an object or a list of objects, "
                                       f"got {_short(spec)}")


def _check_names(value, where: str, what: str) -> None:
    if value is not None and not (isinstance(value, list) and all(isinstance(e, str) for e in value)):
        raise UnreadableCheckpoint(f"{where} must be a list of {what}, got {_short(value)}")


def _check_quantization_config(q: dict, where: str) -> None:
    method = q.get("quant_method")
    if method is not None and not isinstance(method, str):
        raise UnreadableCheckpoint(f"{where}.quant_method must be a string, got {_short(method)}")
    if method == "fp8":
        _check_names(q.get("modules_to_not_convert"), f"{where}.modules_to_not_convert", "module names")
        block = q.get("weight_block_size")
        if block is not None and not (isinstance(block, list) and len(block) == 2 and all(
                isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise UnreadableCheckpoint(f"{where}.weight_block_size must be two positive integers, "
                                       f"got {_short(block)}")
    if method != "quark":
        return
    _check_names(q.get("exclude"), f"{where}.exclude", "module names")
    if q.get("global_quant_config") is not None:
        _check_layer_config(q["global_quant_config"], f"{where}.global_quant_config")
    for key in ("layer_quant_config", "layer_type_quant_config"):
        table = q.get(key)
        if table is None:
            continue
        if not isinstance(table, dict):
            raise UnreadableCheckpoint(f"{where}.{key} must be an object, got {_short(table)}")
        for name, layer in table.items():
            _check_layer_config(layer, f"{where}.{key}[{name!r}]")


def _check_model_type(config: dict, where: str) -> None:
    """What transformers' AutoConfig needs before it can pick a config class (5.x: a missing model_type is a
    ValueError, a list a TypeError): a non-empty string. Whether it names a known class is an engine matter
    (`consistency_findings`)."""
    if "model_type" not in config:
        raise UnreadableCheckpoint(f"{where}: no 'model_type' (transformers' AutoConfig and the engines choose the "
                                   "model class by it)")
    for section, label in ((config, "model_type"), (config.get("text_config") or {}, "text_config.model_type")):
        value = section.get("model_type")
        if "model_type" in section and not (isinstance(value, str) and value.strip()):
            raise UnreadableCheckpoint(f"{where}: '{label}' must be a non-empty string, got {_short(value)}")


def lm_layer_indices(tensor_names) -> set[int]:
    """Decoder-layer indices of the language model the tensor names hold (at most one per tensor)."""
    out = set()
    for name in tensor_names:
        m = LM_LAYER.match(name)
        if m:
            out.add(int(m.group(1)))
    return out


def validate_config(config: dict, path: Path, tensor_names=()) -> None:
    """Raise UnreadableCheckpoint for the first value of `config` (read from `path`) with a wrong type or range,
    or a count beyond what `tensor_names` can hold."""
    where = str(path)
    for key in ("quantization_config", "text_config"):
        if key in config and config[key] is not None and not isinstance(config[key], dict):
            raise UnreadableCheckpoint(f"{where}: '{key}' must be an object, got {_short(config[key])}")
    _check_model_type(config, where)
    archs = config.get("architectures")
    if archs is not None and not (isinstance(archs, list) and archs and all(isinstance(a, str) for a in archs)):
        raise UnreadableCheckpoint(f"{where}: 'architectures' must be a non-empty list of class names, "
                                   f"got {_short(archs)}")
    if isinstance(config.get("quantization_config"), dict):
        _check_quantization_config(config["quantization_config"], f"{where}: quantization_config")
    _check_counts(config, where)
    text = config.get("text_config")
    if isinstance(text, dict):
        _check_counts(text, f"{where}: text_config")
    merged = text_config(config)
    names = list(tensor_names)
    # Any layer-like index counts here (mtp.layers.N too): a bound on loops over declared MTP layers.
    layers = {int(n) for name in names for n in _layer_numbers(name)}
    for key in MTP_COUNT_KEYS:
        count = merged.get(key) or 0
        if count > max(len(layers), 64):
            raise UnreadableCheckpoint(f"{where}: '{key}' is {count}, more layers than the checkpoint's tensor "
                                       f"names hold ({len(layers)} layer indices)")


def _layer_numbers(name: str):
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            yield parts[i + 1]



def load_tensors(path: Path, names: list[str] | None = None, device: str = "cpu") -> dict:
    """Tensor data of one shard (all tensors, or `names`)."""
    out = {}
    try:
        with safe_open(str(path), framework="pt", device=device) as f:
            for name in names if names is not None else list(f.keys()):
                out[name] = f.get_tensor(name)
    except QuantError:
        raise
    except Exception as e:
        raise QuantError(f"{path}: cannot read tensor data ({str(e).splitlines()[0]})") from None
    return out


SCALE_INV = "_scale_inv"  # block-FP8 checkpoints: the suffix of a weight's scales tensor (`W` + SCALE_INV)


@dataclass(frozen=True)
class Source:
    """Where an output tensor's data comes from."""

    name: str
    file: str
    scale_inv: str | None = None  # block-FP8 source: the weight_scale_inv tensor (quant.sources.block_fp8 decodes)
    scale_inv_file: str | None = None
    expert: int | None = None  # a slice [expert, rows] of a fused 3-D expert tensor
    rows: tuple[int, int] | None = None

    def describe(self) -> str:
        if self.expert is None:
            return self.name
        return f"{self.name}[{self.expert}, {self.rows[0]}:{self.rows[1]}]"


class SourceReader:
    """Open shard handles for one shard job; slices of fused experts are read without loading the rest.

    Tensors are views of the shard's memory map, whose pages stay resident while it is mapped; a handle is
    therefore reopened after every REMAP_BYTES it served, which unmaps what the finished tensors touched and
    keeps a worker's resident source near that size instead of a whole shard."""

    REMAP_BYTES = 1 << 28

    def __init__(self, ckpt: Checkpoint, device: str):
        self.ckpt, self.device, self.handles = ckpt, device, {}
        self.served: dict[str, int] = {}
        self.digest = None  # a hashlib object: while set, every tensor's name and stored bytes as read feed it

    @contextlib.contextmanager
    def hashing(self):
        """The sha256 of what is read inside the block (each tensor's name and its bytes as stored, in order):
        yields a callable giving the hex digest once the block is done."""
        self.digest = hashlib.sha256()
        try:
            yield self.digest.hexdigest
        finally:
            self.digest = None

    def handle(self, file: str):
        if self.served.get(file, 0) >= self.REMAP_BYTES:
            del self.handles[file]
            self.served[file] = 0
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
        self.served[file] = self.served.get(file, 0) + t.nbytes
        if self.digest is not None:
            import torch

            self.digest.update(f"{file}:{name}:{expert}:{rows}:{t.dtype}:{list(t.shape)}\0".encode())
            self.digest.update(t.contiguous().view(-1).view(torch.uint8).numpy())
        return t.to(self.device)

    def close(self) -> None:
        self.handles.clear()
