"""Compiled numerics kernels: an ahead-of-time package when one is cached, else `torch.compile`, else eager.

The kernels are written with exact integer/power-of-two arithmetic only, so the compiled and the eager run give
bit-identical results; compiling only fuses them into one pass over memory. On CPU a kernel built by
`quant kernels build` (see `_aot`) loads in milliseconds; otherwise `torch.compile` costs seconds per process (the
C++ compiler runs once per kernel; inductor caches the result on disk), so small tensors, which gain nothing from
it, run eagerly. Set QUANT_NO_COMPILE=1 to never compile. A kernel whose compilation fails (no C++ compiler,
unsupported platform) logs one warning and stays eager for the rest of the process.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from quant.numerics._aot import AotCache, build_package, isa_simdlen

log = logging.getLogger(__name__)

# Below this many input elements a kernel runs eagerly: the first compiled call would cost more than it saves.
COMPILE_MIN_ELEMENTS = 1 << 20


def compile_enabled() -> bool:
    return os.environ.get("QUANT_NO_COMPILE", "") in ("", "0")


def wants_compiled(size: int, compiled: bool | None = None) -> bool | None:
    """How a call on `size` input elements should run: True compiled (a cached package, else torch.compile),
    None a cached package if there is one, else eager (small tensors: torch.compile would cost more than it
    saves), False eager. `compiled` forces True or False; torch.compile failing once makes True mean None.
    """
    if compiled is None:
        if not compile_enabled():
            return False
        compiled = True if size >= COMPILE_MIN_ELEMENTS else None
    return None if compiled and Kernel.any_broken else compiled


def key_inductor_cache_on_isa() -> None:
    """Put the vector width inductor generates code for into its cache key, before the first compile.

    Inductor picks its CPU vector ISA from ATEN_CPU_CAPABILITY, but its on-disk FX-graph cache keys entries on
    its config, not on that variable. A graph compiled under `avx2` (8-float vectors) and served from the same
    cache to a default-ISA AVX-512 process is recompiled there with 16-float `Vectorized<float>`: its full-vector
    stores, stepping 8 at a time, write 8 floats past the end of the output (the FP8 row scales) and glibc aborts
    on the corrupted heap ("double free or corruption", issue #48). `cpp.simdlen` is part of the key, and set to
    the width inductor would pick anyway it changes no generated code. Same class of bug as pytorch/pytorch#184444
    (the thread count left out of that key)."""
    from torch._inductor import config

    if config.cpp.simdlen is None:
        config.cpp.simdlen = isa_simdlen()


class Kernel:
    """A pure tensor function that runs compiled on request; `Kernel.eager` is the same function uncompiled.

    `examples` gives small argument tuples, one per signature the pipeline calls the kernel with, from which
    `build_aot` compiles packages; `dynamic_dims` are the dimensions of each tensor argument that vary by tensor.
    """

    any_broken = False
    registry: list[Kernel] = []

    def __init__(self, fn: Callable, examples: Callable[[], list[tuple]] | None = None,
                 dynamic_dims: tuple[int, ...] = (0,)):
        self.eager = fn
        self.name = fn.__name__.lstrip("_")
        self.examples, self.dynamic_dims = examples, dynamic_dims
        self._compiled: Callable | None = None
        self._broken = False
        self._lock = threading.Lock()  # the pipeline quantizes from several threads (one per device)
        self._aot = AotCache(fn, self.name)
        Kernel.registry.append(self)

    def build_aot(self, force: bool = False) -> Iterator[tuple[Path, bool]]:
        """Compile this kernel's packages for every example signature: [(path, built now)]."""
        for args in self.examples() if self.examples else []:
            yield build_package(self.name, self.eager, args, self.dynamic_dims, force)

    def __call__(self, *args, compiled: bool | None):
        """Run on `args` (tensors) as `wants_compiled` decided: compiled (True), eager (False), or compiled only
        if a package is cached (None)."""
        if compiled is False:
            return self.eager(*args)
        runner = self._aot.runner(args) if self.examples else None
        if runner is not None:
            return runner(args)
        if compiled is None or self._broken:
            return self.eager(*args)
        with self._lock:
            if self._compiled is None:
                key_inductor_cache_on_isa()
                self._compiled = torch.compile(self.eager)
        # Only the leading (block) dimension varies between tensors: one dynamic kernel instead of one per shape.
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() > 0:
                torch._dynamo.maybe_mark_dynamic(a, 0)
        try:
            return self._compiled(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # any failure here is the compiler's: inputs were validated before the call
            self._broken = Kernel.any_broken = True
            log.warning("torch.compile of %s failed (%s: %s); using the eager kernel", self.name,
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return self.eager(*args)

    @property
    def broken(self) -> bool:
        return self._broken
