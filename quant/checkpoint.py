"""A Hugging Face safetensors checkpoint directory, read through its config, index and shard headers.

Opening a checkpoint never reads tensor data: the safetensors library parses each shard's header (and checks
that offsets and sizes fit the file), so this runs in seconds on a terabyte checkpoint. Integrity problems
(index vs headers, missing files, names escaping the directory) are collected as `Problem`s; callers decide
whether they are fatal (`require_intact`) or findings to report (verify-manifest).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from safetensors import safe_open

from quant.errors import QuantError, UnreadableCheckpoint

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# torch is imported lazily: the preflight reads only headers and must not pay torch's import time.
TORCH_DTYPE_NAMES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
                     "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
                     "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
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

    def total_bytes(self) -> int:
        return sum((self.root / f).stat().st_size for f in self.files if (self.root / f).is_file())


def text_config(config: dict) -> dict:
    """A config's language-model fields: vision-language wrappers (Qwen3.5) keep them under text_config."""
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config


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
    problems: list[Problem] = []
    index = None
    expected: dict[str, str] = {}  # tensor -> file, from the index
    if (meta / INDEX_FILE).exists():
        index = read_json(meta / INDEX_FILE)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise UnreadableCheckpoint(f"{meta / INDEX_FILE}: no 'weight_map' object")
        expected = {str(k): str(v) for k, v in weight_map.items()}
        files = sorted(set(expected.values()))
    elif (root / SINGLE_FILE).exists():
        files = [SINGLE_FILE]
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
        if not files:
            raise UnreadableCheckpoint(f"{root}: no {INDEX_FILE} and no *.safetensors files")

    tensors: dict[str, TensorInfo] = {}
    readable: list[str] = []
    for file in files:
        if not is_safe_relative(file):
            problems.append(Problem("unsafe-path", file, None,
                                    f"{root / INDEX_FILE}: file name '{file}' escapes the checkpoint directory"))
            continue
        fpath = root / file
        if not fpath.is_file():
            first = next((t for t, f in expected.items() if f == file), None)
            problems.append(Problem("missing-file", file, first,
                                    f"{fpath}: listed in the index (e.g. for {first}) but missing"))
            continue
        try:
            header = read_shard_header(fpath)
        except Exception as e:  # safetensors raises its own error type for corrupt/truncated headers
            problems.append(Problem("corrupt-shard", file, None,
                                    f"{fpath}: unreadable safetensors file ({str(e).splitlines()[0]})"))
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
    from quant.validate import validate_config

    validate_config(config, meta / "config.json", tensors)
    return Checkpoint(root=root, config=config, tensors=tensors, files=files, index=index, problems=problems)


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
