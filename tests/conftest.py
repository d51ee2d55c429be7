"""Shared fixtures: toy checkpoints are built once per test session (per xdist worker) from tiny configs."""

import os
import tempfile

import pytest

# No vector ISA is forced: the suite runs what a user runs (the machine's default ATen kernels). Results that depend
# on the ISA's float rounding (GPTQ's bytes, a trained toy's logits) are compared by what matters, not by bytes
# (scripts/golden_exports.py); tests/test_numerics_isa.py runs the numerics under every ISA the CPU has.
import quant  # noqa: E402,F401  (sets the OpenMP wait policy before torch loads)

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two xdist workers on two cores: a second intra-op thread per worker only contends (each parallel region
    # then waits a scheduler timeslice), so each worker computes on one thread.
    import torch

    torch.set_num_threads(1)

# Compiled-kernel packages the developer built (`quant kernels build`) must not decide which code path the tests
# exercise: each session starts from an empty cache (tests/test_aot.py builds its own packages).
os.environ["QUANT_CACHE_DIR"] = tempfile.mkdtemp(prefix="quant-test-cache-")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def load_script(name: str):
    """scripts/<name>.py as a module (the benchmarks and golden scripts the tests drive)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_vectors(name: str):
    """The reference vector module tests/data/<name>.py (data only)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / "data" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def one_torch_thread():
    """Many small tensor ops: with xdist workers sharing the cores, one intra-op thread each is much faster."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def toy_factory(tmp_path_factory):
    """toy_factory(name, fp8_block=False, shard_size=None) -> path of a cached toy checkpoint (read-only use)."""
    from quant.toy import build_toy

    cache = {}

    def make(name, fp8_block=False, shard_size=None):
        key = (name, fp8_block, shard_size)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"toy-{name}-{'fp8' if fp8_block else 'bf16'}") / "ckpt"
            cache[key] = build_toy(name, out, fp8_block=fp8_block, shard_size=shard_size, seed=0)
        return cache[key]

    return make


@pytest.fixture
def full_disk(tmp_path):
    """A 1 MiB tmpfs when this machine lets us mount one (root), for a real ENOSPC; else None."""
    import subprocess

    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode:
        yield None
        return
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
