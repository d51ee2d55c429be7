"""Ahead-of-time compiled CPU kernels: built once per machine with AOTInductor, loaded in milliseconds.

`torch.compile` costs every process about five seconds before its first kernel runs (importing dynamo, tracing,
loading the compiled code), which is more than quantizing a few GB takes. `quant kernels build` exports each
numerics kernel once and compiles it into a package in the cache directory; a later process loads the package
through torch's C++ loader without importing dynamo or inductor. A package is keyed by the kernel's name, the
argument signature, the source of the numerics modules, the torch version and the CPU's vector ISA, so a changed
kernel or a different machine never picks up a stale one. Without a package, kernels fall back to `torch.compile`.

Cache directory: $QUANT_CACHE_DIR, else $XDG_CACHE_HOME/moe-quant, else ~/.cache/moe-quant. QUANT_NO_AOT=1 ignores it.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import os
import platform
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from quant.paths import cache_root

log = logging.getLogger(__name__)

def cache_dir() -> Path:
    return cache_root()


def aot_enabled() -> bool:
    return os.environ.get("QUANT_NO_AOT", "") in ("", "0")


@functools.cache
def _source_digest(module_file: str) -> str:
    """Digest of the module that defines a kernel (with its helpers: kernels only call their own module)."""
    return hashlib.sha256(Path(module_file).read_bytes()).hexdigest()[:16]


def signature(args: Sequence) -> str:
    """The argument signature a package is compiled for: dtype and rank of each tensor argument."""
    return "-".join(f"{str(a.dtype).removeprefix('torch.')}_{a.dim()}d" for a in args)


# Part of every package's name: a change to how packages are built (here: the vector-width choice) rebuilds them.
BUILD_RULE = "t1"


def machine_dir() -> Path:
    """Where this torch build's kernels for this CPU architecture and vector ISA live."""
    machine = f"{platform.machine()}-{torch.backends.cpu.get_cpu_capability()}".lower()
    return cache_dir() / "kernels" / f"torch-{torch.__version__}-{machine}"


def package_path(fn: Callable, name: str, sig: str) -> Path:
    key = f"{name}-{sig}-{_source_digest(inspect.getsourcefile(fn))}{BUILD_RULE}"
    return machine_dir() / f"{key}.pt2"


class _Runner:
    """A loaded package: call it with the kernel's tensor arguments, get the kernel's return structure back."""

    def __init__(self, path: Path):
        # Concurrent calls (one worker thread per device) each need a runner of their own; more wait for one.
        runners = min(8, max(2, os.cpu_count() or 1))
        self._loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, runners, -1)
        self._returns_tuple = self._loader.get_metadata().get("quant_returns_tuple") == "1"

    def __call__(self, args: Sequence[torch.Tensor]):
        out = self._loader.run([a.contiguous() for a in args])
        return tuple(out) if self._returns_tuple else out[0]


class AotCache:
    """Packages of one kernel, loaded lazily per argument signature (None where there is no usable package)."""

    instances: list[AotCache] = []

    def __init__(self, fn: Callable, name: str):
        self.fn, self.name = fn, name
        self._runners: dict[str, _Runner | None] = {}
        self._lock = threading.Lock()
        AotCache.instances.append(self)

    @classmethod
    def release_all(cls) -> None:
        """Unload every package: a loader deletes the directory it unpacked its package into."""
        for cache in cls.instances:
            cache._runners.clear()

    def runner(self, args: Sequence) -> _Runner | None:
        if not aot_enabled() or not all(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args):
            return None
        sig = signature(args)
        if sig not in self._runners:
            with self._lock:
                if sig not in self._runners:
                    self._runners[sig] = self._load(package_path(self.fn, self.name, sig))
        return self._runners[sig]

    def _load(self, path: Path) -> _Runner | None:
        if not path.is_file():
            return None
        try:
            return _Runner(path)
        except Exception as e:  # a package from a damaged cache or an incompatible torch build
            log.warning("cannot load the compiled kernel %s (%s); falling back to torch.compile or eager", path,
                        str(e).splitlines()[0])
            return None


class _Call(torch.nn.Module):
    """The kernel as a module with positional tensor arguments, as torch.export wants it."""

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def isa_simdlen() -> int:
    """The vector width in bits inductor generates code for in this process (ATEN_CPU_CAPABILITY picks it; 0 for
    `default`, no vectors)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return pick_vec_isa().bit_width()


def simd_candidates() -> list[int | None]:
    """Vector widths to try per kernel: the ISA's own (None), and 256 bits on AVX-512 machines. Which is faster
    depends on the kernel and the machine: on a 2-core AVX-512 VM the MXFP4 kernels ran 1.8x faster with 256-bit
    vectors and block FP8 2.6x slower (ATen has a vectorised float8 conversion for AVX-512 only)."""
    return [None, 256] if torch.backends.cpu.get_cpu_capability() == "AVX512" else [None]


def _timing_args(example: Sequence, elements: int = 1 << 22) -> tuple:
    """The example repeated along dim 0 (the block dimension of every kernel) to about `elements` elements."""
    first = next(a for a in example if isinstance(a, torch.Tensor) and a.dim() > 0)
    reps = max(1, elements // max(1, first.numel()))
    return tuple(a.repeat(reps, *([1] * (a.dim() - 1))) if isinstance(a, torch.Tensor) and a.dim() > 0 else a
                 for a in example)


def _median_seconds(runner: _Runner, args: tuple, calls: int = 7) -> float:
    runner(args)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        runner(args)
        times.append(time.perf_counter() - start)
    return sorted(times)[calls // 2]


def build_package(name: str, fn: Callable, example: Sequence[torch.Tensor], dynamic_dims: Sequence[int],
                  force: bool = False) -> tuple[Path, bool]:
    """Export `fn` on `example` (the dims in `dynamic_dims` of each tensor argument left symbolic) and compile it
    into its package, once per vector width of `simd_candidates()`, keeping the fastest on this machine (timed on
    the example repeated to 4M elements); returns (path, whether it was built now). Written to temporary names,
    then renamed; the width chosen is in the package metadata (`quant_simdlen`)."""
    path = package_path(fn, name, signature(example))
    if path.is_file() and not force:
        return path, False
    import torch._inductor  # noqa: F401  (only building needs the compiler stack)

    dyn = torch.export.Dim.DYNAMIC
    shapes = tuple({d: dyn for d in dynamic_dims if d < a.dim()} or None for a in example)
    returns_tuple = isinstance(fn(*example), tuple)
    program = torch.export.export(_Call(fn), tuple(example), dynamic_shapes=(shapes,))
    path.parent.mkdir(parents=True, exist_ok=True)
    candidates = simd_candidates()
    built = []
    for simdlen in candidates:
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.simd{simdlen or 'native'}.tmp.pt2")
        configs = {"aot_inductor.metadata": {"quant_returns_tuple": "1" if returns_tuple else "0",
                                             "quant_kernel": json.dumps([name, signature(example)]),
                                             "quant_simdlen": str(simdlen or "native")}}
        # Always explicit: the width is then part of inductor's cache key (see _compile.key_inductor_cache_on_isa).
        configs["cpp.simdlen"] = simdlen or isa_simdlen()
        torch._inductor.aoti_compile_and_package(program, package_path=str(tmp), inductor_configs=configs)
        built.append(tmp)
    if len(built) > 1:
        args = _timing_args(example)
        seconds = [_median_seconds(_Runner(tmp), args) for tmp in built]
        best = built[seconds.index(min(seconds))]
        log.info("%s(%s): %s", name, signature(example),
                 ", ".join(f"simdlen {c or 'native'} {1e3 * t:.2f} ms" for c, t in zip(candidates, seconds)))
    else:
        best = built[0]
    os.replace(best, path)
    for tmp in built:
        tmp.unlink(missing_ok=True)
    return path, True


def package_simdlen(path: Path) -> str:
    """The vector width a package was built with ("native" or a number of bits)."""
    loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    return loader.get_metadata().get("quant_simdlen", "native")
