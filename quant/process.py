"""Process-level tuning, in one place: the environment OpenMP and OpenBLAS read when they load, glibc's
allocator, the garbage collector around torch's import, the compute threads of a run, and the fast exit.

Each measure says what it saves and where it was measured; none changes a result, only the time or memory it
takes. `quant/__init__.py` calls `thread_env()` (it must run before torch loads OpenMP), the quantize command
calls `reuse_freed_memory()`, the pipeline uses `frozen_imports` and `set_threads`, the CLI `exit_now` and
`supervise` (each command in a child process, whose native crash becomes one line). And the
accelerators the process can use (`visible_accelerators`, `auto_devices`: what `--devices auto` means, for the
run and its dry run alike).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path


def thread_env() -> None:
    """Defaults for the thread pools, set before torch (and numpy) load them; a user's own setting wins.

    Inductor's compiled kernels and eager ATen ops each run OpenMP parallel regions; with the default active
    wait, threads of one spin through the other's work: on 2 cores an eager dequantize after a compiled quantize
    ran 40x slower (544 ms vs 12 ms for 128 rows of a GLM-5 expert). Compiling in-process avoids a pool of busy
    compile workers. numpy (imported to read safetensors headers) starts OpenBLAS's thread server, whose idle
    thread spins for a tenth of a second on a core the source hashing needs; nothing here multiplies matrices
    with numpy."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def bars_off_a_terminal() -> None:
    """Off a terminal (a log file, a pipe), the libraries' tqdm bars off: transformers' weight loading, lm-eval's
    request loops and huggingface_hub's downloads each write one `\r`-joined line there, and the tool's own lines
    say what runs and how far it is. tqdm reads TQDM_* once, when it is first imported, so this is set before any
    library loads it; a user's own TQDM_DISABLE wins (set empty, the bars stay: tqdm reads any other value as
    true, "0" too)."""
    if not sys.stderr.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")


def reuse_freed_memory() -> None:
    """Have glibc keep freed memory for reuse instead of returning it to the kernel.

    Each shard allocates and frees hundreds of MB of same-sized tensors. By default glibc maps every block of more
    than a few MB afresh and unmaps it on free, so each shard's tensors land on new pages the kernel must zero (on a
    VM, pages the host may have to back again): 15% of the CPU time of a 2-core run. Blocks up to 32 MB now come
    from the heap and stay there. glibc only; elsewhere nothing changes.
    """

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum
    mallopt(m_trim_threshold, 1 << 30)
    mallopt(m_top_pad, 256 << 20)


@contextlib.contextmanager
def frozen_imports(imports: Callable[[], None]) -> Iterator[None]:
    """Run `imports` with the garbage collector off, and keep what they created frozen until the block ends.

    The run's first import of torch creates a few hundred thousand objects and no garbage; the collector would
    walk them over and over, during the import and the whole run (8% of the CPU time on two cores). A caller
    that froze objects itself keeps them frozen (nothing is thawed that this did not freeze)."""
    collecting, freezing = gc.isenabled(), gc.get_freeze_count() == 0
    gc.disable()
    try:
        imports()
    finally:
        if freezing:
            gc.freeze()
        if collecting:
            gc.enable()
    try:
        yield
    finally:
        if freezing:
            gc.unfreeze()


def cpu_threads(workers: int) -> int:
    """Intra-op threads of each of `workers` CPU workers: the cores left after one for hashing and writing,
    shared by the workers. On two cores that is one thread: a second one would wait a scheduler timeslice at the
    end of each kernel whenever the hasher holds its core (seconds per run, and irregular)."""
    return max(1, ((os.cpu_count() or 1) - 1) // max(1, workers))


def set_threads(n: int) -> None:
    """torch's intra-op threads for the calling thread (OpenMP keeps a count per thread: the compiled kernels
    read the worker thread's own)."""
    import torch

    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def exit_now(code) -> None:
    """Exit; once torch is loaded, without the interpreter's finalization, which then tears down thousands of
    modules and native objects: 0.6 s on two cores, a seventh of quantizing 3 GB. Every file is closed by now;
    what finalization would still do is flushed or released here. A Ctrl-C during `import torch` leaves its
    native half loaded but `torch` out of sys.modules; finalizing that half died of SIGINT (exit -2, not 130),
    hence the test on any torch module."""
    if not any(name == "torch" or name.startswith("torch.") for name in sys.modules):
        sys.exit(code)
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    aot = sys.modules.get("quant.numerics._aot")  # never imported here: that would import torch again
    if aot is not None:
        aot.AotCache.release_all()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def visible_accelerators() -> int:
    """CUDA/ROCm devices torch can use. torch is imported only when the machine has an NVIDIA or AMD GPU device
    node: its import costs a second that the CPU path spends hashing instead."""
    dev = Path("/dev")
    if not (any(dev.glob("nvidia[0-9]*")) or (dev / "kfd").exists()):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def auto_devices(workers: int, accelerators: int) -> list[str]:
    """`--devices auto`: one worker per visible GPU, else `workers` CPU workers."""
    return [f"cuda:{i}" for i in range(accelerators)] if accelerators else ["cpu"] * max(1, workers)


def usable_cpu_attention() -> None:
    """Keep torch's CPU attention on kernels this process's ATen build can run.

    torch 2.13 picks its bfloat16 flash-attention CPU kernel's AMX path from what the CPU has, not from the vector
    ISA ATen runs with: under ATEN_CPU_CAPABILITY=avx2 (or default) on an AMX Xeon every bf16
    scaled_dot_product_attention raises "pack_vnni2 is only supported when avx512 is supported". There the flash
    kernel is switched off (the math kernel is the reference it approximates); everywhere else nothing changes."""
    import torch

    if torch.backends.cpu.get_cpu_capability() in ("AVX512", "ZVECTOR", "VSX", "NEON", "SVE256") \
            or not os.path.exists("/proc/cpuinfo") or " amx_bf16" not in open("/proc/cpuinfo").read():
        return
    torch.backends.cuda.enable_flash_sdp(False)  # torch's one switch for the flash kernel, CPU's included


# -------------------------------------------------------------------------------------------- native crashes
SUPERVISED_ENV = "QUANT_SUPERVISED"  # set for the child by its supervisor (and removed again by the child)
NO_SUPERVISOR_ENV = "QUANT_NO_SUPERVISOR"
CRASH_SIGNALS = ("SIGSEGV", "SIGABRT", "SIGBUS", "SIGILL", "SIGFPE")
_FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
_decided = False


def supervise() -> int | None:
    """Run this command line again in a child process and wait for it: its exit code, or None in the child itself
    (and where supervision is off: QUANT_NO_SUPERVISOR=1, or not a POSIX system), which then runs the command.

    Why: a native fault (a heap corruption in a compiled kernel, a segfault in a library) kills the process before
    any Python code can report it, and reached the user as glibc's "double free or corruption" and exit 134. Seen
    from a parent it is one line and exit 70 (a bug, as the README's table says). Any other death by a signal is
    passed on as it is (the parent dies of the same signal: a shell's 141 for SIGPIPE, what torchrun reports for
    a killed rank). Signals sent to the parent are passed to the child; a terminal's Ctrl-C reaches both already.
    The child dies with its parent (PR_SET_PDEATHSIG), so killing the parent never leaves it running."""

    global _decided
    if _decided:  # `quant` runs quant.cli's main after its own: one decision per process
        return None
    _decided = True
    if os.environ.pop(SUPERVISED_ENV, None) is not None or os.environ.get(NO_SUPERVISOR_ENV, "") not in ("", "0") \
            or os.name != "posix" or not hasattr(signal, "sigwaitinfo"):
        return None
    watched = {getattr(signal, name) for name in _FORWARDED} | {signal.SIGCHLD}
    signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    try:
        child = subprocess.Popen(sys.orig_argv, env={**os.environ, SUPERVISED_ENV: "1"},
                                 preexec_fn=lambda: _child_setup(watched))
    except OSError:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, watched)
        return None
    while child.poll() is None:
        info = signal.sigtimedwait(watched, 1.0)
        # si_code <= 0: sent by a process (kill, sigqueue, tgkill) to this one; a terminal's (SI_KERNEL) and the
        # child's SIGCHLD are not passed on
        if info is not None and info.si_signo != signal.SIGCHLD and info.si_code <= 0:
            child.send_signal(info.si_signo)
    if child.returncode >= 0:
        return child.returncode
    died_of = signal.Signals(-child.returncode)
    if died_of.name in CRASH_SIGNALS:
        sys.stderr.write(f"error: internal error (the process died of {died_of.name}: a native crash in torch, a "
                         "compiled kernel or a library); please report it (PYTHONFAULTHANDLER=1 prints where)\n")
        sys.stderr.flush()
        return 70
    if died_of not in (signal.SIGKILL, signal.SIGSTOP):  # the two whose disposition cannot be set
        signal.signal(died_of, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, watched)
    os.kill(os.getpid(), died_of)
    return 128 + died_of


def _child_setup(blocked: set) -> None:
    """In the child, before exec: the signals the supervisor blocked unblocked, and death with the parent."""

    signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux; elsewhere there is no such call)
    except (OSError, AttributeError):
        pass
