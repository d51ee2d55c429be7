"""The compiled numerics kernels are bit-identical to the eager reference on every vector ISA this machine can
run: inductor generates different code per ISA (it reads ATEN_CPU_CAPABILITY), so each is compiled afresh in a
subprocess (its own inductor and kernel caches) and compared with the eager kernels: MXFP4 bf16 and fp32 input in
every scale mode, and 128x128 block FP8."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(name="numerics-isa")]

SCRIPT = r"""
import json, torch
from quant.numerics import fp8, mxfp4
g = torch.Generator().manual_seed(0)
x = torch.randn(512, 2304, generator=g) * torch.logspace(-30, 3, 2304)  # 1.2M elements: above the compile threshold
x[0, :64] = 0.0
x[1, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)  # midpoints: ties to even
mismatches = []
for dtype in (torch.bfloat16, torch.float32):
    t = x.to(dtype)
    for mode in ("floor", "even", "rceil", "search"):
        a, b = mxfp4.quantize_mxfp4(t, mode, compiled=False), mxfp4.quantize_mxfp4(t, mode, compiled=True)
        if not (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])):
            mismatches.append(f"mxfp4 {mode} {dtype}")
    a, b = fp8.quantize_fp8_block(t, compiled=False), fp8.quantize_fp8_block(t, compiled=True)
    if not (torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])):
        mismatches.append(f"fp8 block {dtype}")
from quant.numerics._compile import Kernel
print(json.dumps({"isa": torch.backends.cpu.get_cpu_capability(), "mismatches": mismatches,
                  "broken": Kernel.any_broken}))
"""


def _isas() -> list[str]:
    import torch

    native = torch.backends.cpu.get_cpu_capability().lower()  # what this process runs (ATEN_CPU_CAPABILITY or the CPU)
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    found = {isa for isa, flag in (("avx2", " avx2"), ("avx512", " avx512bw")) if flag in flags}
    return sorted({native} | found)


@pytest.mark.parametrize("isa", _isas())
def test_compiled_kernels_match_eager_on_each_isa(isa, tmp_path):
    env = {**os.environ, "ATEN_CPU_CAPABILITY": isa, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "QUANT_CACHE_DIR": str(tmp_path / "kernels"), "QUANT_NO_COMPILE": "0"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["isa"].lower() == isa and not result["broken"], result
    assert result["mismatches"] == [], result


SHARED_CACHE_SCRIPT = r"""
import json, torch
from quant.numerics import fp8
x = torch.randn(2053, 1027, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)  # odd row count: a tail
q, s = fp8.quantize_fp8_per_channel(x, compiled=True)
r, t = fp8.quantize_fp8_per_channel(x, compiled=False)
print(json.dumps({"isa": torch.backends.cpu.get_cpu_capability(),
                  "equal": torch.equal(q.view(torch.uint8), r.view(torch.uint8)) and torch.equal(s, t)}))
"""


@pytest.mark.skipif(not {"avx2", "avx512"} <= set(_isas()), reason="needs a CPU with AVX2 and AVX-512")
def test_one_inductor_cache_serves_every_isa(tmp_path):
    """Issue #48: a kernel compiled under ATEN_CPU_CAPABILITY=avx2, then served from the same inductor cache to a
    process on the machine's own AVX-512, aborted with a corrupted heap (inductor's cache did not key on the ISA;
    quant/numerics/_compile.key_inductor_cache_on_isa). Each run, in this order, must finish with the eager bytes."""
    base = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    base.update(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), QUANT_CACHE_DIR=str(tmp_path / "kernels"),
                QUANT_NO_COMPILE="0", QUANT_NO_AOT="1")
    for isa in ("avx2", None, "avx512", "default"):
        env = {**base, **({"ATEN_CPU_CAPABILITY": isa} if isa else {})}
        proc = subprocess.run([sys.executable, "-c", SHARED_CACHE_SCRIPT], env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, f"ATEN_CPU_CAPABILITY={isa}: exit {proc.returncode}\n{proc.stderr[-1500:]}"
        assert json.loads(proc.stdout.strip().splitlines()[-1])["equal"], isa
