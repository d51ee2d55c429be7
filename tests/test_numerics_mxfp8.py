"""MXFP8 numerics (quant/numerics/mxfp8.py) against the format's own references: ml_dtypes' float8_e4m3fn and
float8_e8m0fnu (element and scale decoding, element rounding), and amd-quark 0.13's own MX quantizer (its
PerBlockMXObserver scale and fake_quantize_fp8_per_group_with_scale elements), run in .venv-quark's interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from quant.errors import QuantError
from quant.numerics import mxfp8

REPO = Path(__file__).resolve().parent.parent
QUARK_PYTHON = REPO / ".venv-quark" / "bin" / "python"


def _inputs(seed: int = 0) -> torch.Tensor:
    """Rows of 32-element blocks: random scales over 60 binades, plus blocks whose amax sits on each rounding
    threshold (significand 1.75 and 1.9375, just below and above), all-zero, tiny, huge and fp32-subnormal blocks."""
    g = torch.Generator().manual_seed(seed)
    rand = torch.randn(64, 256, generator=g) * torch.exp2(torch.randint(-30, 30, (64, 1), generator=g).float())
    special = torch.randn(16, 32, generator=g).clamp(-1, 1)
    amax = torch.tensor([1.75, 1.75 + 2**-23, 1.9375 - 2**-23, 1.9375, 1.5, 1.0, 2 - 2**-23, 448.0,
                         449.0, 2.0**-120, 2.0**120, 3.0 * 2**100, 1e-40, 0.0, 1.875, 1.96875])
    special[:, 0] = amax * torch.where(torch.arange(16) % 2 == 0, 1.0, -1.0)
    special[13] = 0.0
    special[12, 1:] = special[12, 1:] * 1e-40
    return torch.cat([rand, torch.nn.functional.pad(special, (0, 224))], 0)


def _reference(x: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """The spec in float64 with ml_dtypes: e = floor(log2 amax) - 8 (+1 per mode), clamped to [-127, 127]; elements
    x / 2^e clamped to +-448 and cast (round to nearest even) to float8_e4m3fn."""
    blocks = x.astype(np.float64).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(-1)
    mant, exp = np.frexp(amax)  # amax = mant * 2^exp, mant in [0.5, 1)
    sig = mant * 2  # in [1, 2)
    up = {"floor": np.zeros_like(sig, bool), "even": sig >= 1.9375, "rceil": sig > 1.75}[mode]
    e = np.where(amax > 2.0**-126, exp - 1 - 8 + up, -127).clip(-127, 127)
    byte = (e + 127).astype(np.uint8)
    scale = byte.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    q = np.clip(blocks / scale[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q.reshape(x.shape), byte


@pytest.mark.parametrize("mode", mxfp8.SCALE_MODES)
def test_codes_and_scales_match_ml_dtypes(mode):
    x = _inputs()
    q, scales = mxfp8.quantize_mxfp8(x, mode)
    want_q, want_scales = _reference(x.numpy(), mode)
    np.testing.assert_array_equal(scales.numpy(), want_scales)
    np.testing.assert_array_equal(q.view(torch.uint8).numpy(), want_q.view(np.uint8))
    back = mxfp8.dequantize_mxfp8(q, scales)
    decoded = (want_q.astype(np.float64).reshape(*want_scales.shape, 32)
               * want_scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)[..., None])
    np.testing.assert_array_equal(back.numpy().astype(np.float64), decoded.reshape(x.shape))


def test_the_modes_differ_where_the_spec_says():
    x = torch.zeros(3, 32)
    x[0, 0], x[1, 0], x[2, 0] = 1.8, 1.95, 1.5  # significands 1.8, 1.95, 1.5 (exponent 0)
    bytes_ = {m: mxfp8.quantize_mxfp8(x, m)[1][:, 0].tolist() for m in mxfp8.SCALE_MODES}
    assert bytes_ == {"floor": [119, 119, 119], "even": [119, 120, 119], "rceil": [120, 120, 119]}
    q, _ = mxfp8.quantize_mxfp8(x, "floor")
    assert q[0, 0].item() == 448.0  # 1.8 * 2^8 = 460.8 saturates under floor


def test_bf16_input_and_errors():
    x = _inputs(1).to(torch.bfloat16)
    q, s = mxfp8.quantize_mxfp8(x)
    q32, s32 = mxfp8.quantize_mxfp8(x.float())
    assert torch.equal(q.view(torch.uint8), q32.view(torch.uint8)) and torch.equal(s, s32)
    with pytest.raises(QuantError, match="multiple of 32"):
        mxfp8.quantize_mxfp8(torch.ones(2, 48))
    with pytest.raises(QuantError, match="NaN or Inf"):
        mxfp8.quantize_mxfp8(torch.full((1, 32), float("inf")))


QUARK_SCRIPT = """
import json
import sys
import numpy as np
import torch
from quark.torch.quantization.config.config import OCP_MXFP8E4M3Spec
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase

x = torch.from_numpy(np.load(sys.argv[1]))
spec = OCP_MXFP8E4M3Spec(ch_axis=-1, is_dynamic=False).to_quantization_spec()
fq = FakeQuantizeBase.get_fake_quantize(spec, device=torch.device("cpu"))
qdq = fq(x)
np.savez(sys.argv[2], qdq=qdq.float().numpy(), scale=fq.scale.float().numpy())
specs = {str(d): OCP_MXFP8E4M3Spec(ch_axis=-1, is_dynamic=d).to_quantization_spec().to_dict() for d in (False, True)}
print("SPECS" + json.dumps(specs))
"""


@pytest.mark.skipif(not QUARK_PYTHON.exists(), reason="no .venv-quark (amd-quark 0.13)")
def test_matches_amd_quark_0_13(tmp_path):
    """Quark's OCP_MXFP8E4M3Spec (scale_calculation_mode "even", its default) on the same input: the same scale
    per block and the same quantize-dequantize values, bit for bit."""
    x = _inputs(2)
    x = x[[i for i in range(x.shape[0]) if i != 64 + 12]]  # Quark flushes fp32-subnormal blocks differently (eps)
    np.save(tmp_path / "x.npy", x.numpy())
    script = tmp_path / "quark_mxfp8.py"
    script.write_text(QUARK_SCRIPT)
    run = subprocess.run([str(QUARK_PYTHON), str(script), str(tmp_path / "x.npy"), str(tmp_path / "out.npz")],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    ref = np.load(tmp_path / "out.npz")
    q, scales = mxfp8.quantize_mxfp8(x, "even")
    np.testing.assert_array_equal(mxfp8.scale_values(scales).numpy(), ref["scale"].reshape(scales.shape))
    np.testing.assert_array_equal(mxfp8.dequantize_mxfp8(q, scales).numpy(), ref["qdq"])
    # and the tensor specs the Quark config of a w_mxfp8_a_mxfp8 export carries are Quark's own, key for key
    from quant.pipeline.quark_config import layer_config

    specs = json.loads(run.stdout.split("SPECS", 1)[1])
    written = layer_config("w_mxfp8_a_mxfp8", "even")
    assert json.dumps(written["weight"]) == json.dumps(specs["False"])  # same keys, order and values
    assert json.dumps(written["input_tensors"]) == json.dumps(specs["True"])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
