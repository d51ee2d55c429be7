"""The native MXFP4 / block-FP8 kernels (native/kernels.cpp): built by `quant kernels build`, loaded with ctypes.

Why: inductor's CPU code for these kernels is scalar where ATen's AVX2 vector library has no conversion (int32 ->
uint8 codes, fp32 -> float8_e4m3fn), so on AVX2-only machines the compiled kernels ran at a fifth of their AVX-512
speed. kernels.cpp does the same integer arithmetic as the torch kernels, bit for bit, in one pass per block with
explicit vectors of the ISA torch runs with (ATEN_CPU_CAPABILITY): AVX2 or AVX-512. Other CPUs, a missing C++
compiler, or QUANT_NO_AOT=1 leave the torch kernels (AOT package, torch.compile or eager) in charge; the eager torch
kernels stay the reference every native result is tested against.

The library is cached next to the AOT packages, keyed by the source's digest and the vector ISA; no torch headers
are needed, so building it takes about a second.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from quant.numerics._aot import aot_enabled, machine_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "native" / "kernels.cpp"
ABI = 1
# -O3 but never -ffast-math: the fp32 division and addition must round as torch's do.
_FLAGS = {
    "AVX2": ["-mavx2", "-mfma", "-msse4.1"],
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-msse4.1"],
}
# Work per thread below which splitting a call costs more than it gains (blocks of 32 elements).
_MIN_BLOCKS_PER_THREAD = 1 << 13


def _isa() -> str | None:
    cap = torch.backends.cpu.get_cpu_capability()
    return cap if cap in _FLAGS else None


def library_path() -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    return machine_dir() / f"native-kernels-{digest}.so"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def build(force: bool = False) -> tuple[Path, bool] | None:
    """Compile the library for this machine's ISA: (path, built now), or None where it does not apply."""
    isa, cxx = _isa(), _compiler()
    if isa is None or cxx is None:
        return None
    path = library_path()
    if path.is_file() and not force:
        return path, False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.so")
    subprocess.run([cxx, "-O3", "-std=c++17", "-fPIC", "-shared", "-Wno-psabi", *_FLAGS[isa], str(SOURCE), "-o",
                    str(tmp)], check=True, capture_output=True, text=True)
    os.replace(tmp, path)
    library.cache_clear()
    return path, True


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built library for this ISA, or None (not built, disabled, or unusable)."""
    if not aot_enabled() or _isa() is None:
        return None
    path = library_path()
    if not path.is_file():
        return None
    try:
        lib = ctypes.CDLL(str(path))
        if lib.quant_native_abi() != ABI:
            raise OSError(f"ABI {lib.quant_native_abi()} != {ABI}")
    except OSError as e:
        log.warning("cannot load the native kernels %s (%s); using the torch kernels", path, e)
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.quant_mxfp4_bf16.argtypes = [p, i64, ctypes.c_int32, p, p]
    lib.quant_mxfp4_bf16.restype = ctypes.c_int
    for fn in (lib.quant_fp8_tiles_bf16, lib.quant_fp8_tiles_f32):
        fn.argtypes, fn.restype = [p, i64, i64, p, p], None
    return lib


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="quant-native")


def _split(n: int, work_per_item: int) -> list[tuple[int, int]]:
    """[start, stop) ranges over n items for torch's intra-op thread count (ctypes releases the GIL)."""
    parts = max(1, min(torch.get_num_threads(), n * work_per_item // _MIN_BLOCKS_PER_THREAD))
    step = -(-n // parts)
    return [(i, min(n, i + step)) for i in range(0, n, step)]


def _parallel(fn, ranges: list[tuple[int, int]]) -> list:
    if len(ranges) == 1:
        return [fn(*ranges[0])]
    return list(_pool(len(ranges)).map(lambda r: fn(*r), ranges))


def mxfp4_bf16(x: torch.Tensor, round_up_from: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """mxfp4._encode_bf16 on a contiguous bf16 tensor: (packed [N, 16], bytes [N], flag)."""
    lib = library()
    n = x.numel() // 32
    packed = torch.empty((n, 16), dtype=torch.uint8)
    byte = torch.empty(n, dtype=torch.uint8)
    src, pk, sc = x.data_ptr(), packed.data_ptr(), byte.data_ptr()

    def run(a: int, b: int) -> int:
        return lib.quant_mxfp4_bf16(src + 64 * a, b - a, round_up_from, pk + 16 * a, sc + a)

    return packed, byte, any(_parallel(run, _split(n, 1)))


def fp8_tiles(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8._quantize_tiles on contiguous tiles [R, 128, TI, 128] (bf16 or fp32): (q like x, scale [R, 1, TI, 1])."""
    lib = library()
    rows, ti = x.shape[0], x.shape[2]
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty((rows, 1, ti, 1), dtype=torch.float32)
    fn = lib.quant_fp8_tiles_bf16 if x.dtype == torch.bfloat16 else lib.quant_fp8_tiles_f32
    row = 128 * ti * 128
    src, dst, sc, size = x.data_ptr(), q.data_ptr(), scale.data_ptr(), x.element_size()

    def run(a: int, b: int) -> None:
        fn(src + a * row * size, b - a, ti, dst + a * row, sc + a * ti * 4)

    _parallel(run, _split(rows, row // 32))
    return q, scale
