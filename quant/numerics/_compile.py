"""`torch.compile` for the numerics kernels, with an automatic eager fallback.

The kernels are written with exact integer/power-of-two arithmetic only, so the compiled and the eager run give
bit-identical results; compiling only fuses them into one pass over memory. Compiling a kernel costs seconds (the
C++ compiler runs once per kernel and process; inductor caches the result on disk), so small tensors, which gain
nothing from it, run eagerly. Set QUANT_NO_COMPILE=1 to never compile. A kernel whose compilation fails (no C++
compiler, unsupported platform) logs one warning and stays eager for the rest of the process.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

# Below this many input elements a kernel runs eagerly: the first compiled call would cost more than it saves.
COMPILE_MIN_ELEMENTS = 1 << 20


def compile_enabled() -> bool:
    return os.environ.get("QUANT_NO_COMPILE", "") in ("", "0")


def wants_compiled(size: int, compiled: bool | None = None) -> bool:
    """Whether a call on `size` input elements should run compiled (`compiled` forces it; None decides by size).

    False once any kernel failed to compile, so callers size their chunks for eager execution.
    """
    if compiled is None:
        compiled = size >= COMPILE_MIN_ELEMENTS and compile_enabled()
    return compiled and not Kernel.any_broken


class Kernel:
    """A pure tensor function that runs compiled on request; `Kernel.eager` is the same function uncompiled."""

    any_broken = False

    def __init__(self, fn: Callable):
        self.eager = fn
        self.name = fn.__name__
        self._compiled: Callable | None = None
        self._broken = False
        self._lock = threading.Lock()  # the pipeline quantizes from several threads (one per device)

    def __call__(self, *args, compiled: bool):
        """Run on `args` (tensors), compiled or eager."""
        if not compiled or self._broken:
            return self.eager(*args)
        with self._lock:
            if self._compiled is None:
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
