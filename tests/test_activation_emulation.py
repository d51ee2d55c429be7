"""`quant eval --activations emulate` (issue #33 item 5): in process, each quantized linear's input is
quantize-dequantized as the export's scheme says, by quant.numerics, before the BF16 matmul. On the trained toy:
a W4A4 export's log-probabilities move, a weight-only export's stay bit for bit, and what reaches every hooked
linear is quant.numerics' QDQ of what would have reached it. (Equality with amd-quark's own emulation is the
transformers tier's: tests_engines/test_activation_emulation.py.)"""

from pathlib import Path

import pytest
import torch

from evals.arms.backends import load_checkpoint_model
from quant.checkpoint import open_checkpoint
from quant.dequant import ActivationFormat, activation_formats, qdq_activation
from quant.errors import QuantError
from quant.numerics import fp8, mxfp4, mxfp8
from quant.pipeline import quantize_checkpoint

FIXTURE = Path(__file__).resolve().parent.parent / "evals" / "data" / "toy_arith" / "model"
PROMPTS = [[1, 5, 9, 20, 33, 40, 41, 42, 50, 60, 7, 3], [256, 17, 18, 19, 101, 102, 103, 200]]

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(name="activation-emulation")]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    out = {}
    for scheme, recipe in (("w_mxfp4_a_mxfp4", None), ("w_mxfp4", None), ("fp8-block", "all-linear"),
                           ("w_mxfp8_a_mxfp8", "all-linear")):
        out[scheme] = root / scheme
        quantize_checkpoint(FIXTURE, out[scheme], scheme=scheme, recipe=recipe, check_engines=None,
                            log=lambda m: None)
    return out


def logprobs(model) -> list[torch.Tensor]:
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1) for ids in PROMPTS]


def load(path: Path, tmp_path: Path, activations: str | None):
    model, _, description, notes = load_checkpoint_model(path, tmp_path / (activations or "default"),
                                                         activations=activations, device="cpu")
    return model, description, notes


def test_emulate_moves_w4a4_logprobs_and_leaves_weight_only_ones(exports, tmp_path):
    w4a4 = {mode: load(exports["w_mxfp4_a_mxfp4"], tmp_path, mode) for mode in (None, "emulate", "bf16")}
    assert w4a4[None][0].quant_activations == "emulate"  # the default where the scheme quantizes activations
    assert w4a4["bf16"][0].quant_activations == "bf16"
    assert "activations emulated" in w4a4[None][1] and "MXFP4 on" in " ".join(w4a4[None][2])
    emulated, plain = logprobs(w4a4["emulate"][0]), logprobs(w4a4["bf16"][0])
    default = logprobs(w4a4[None][0])
    assert all(torch.equal(a, b) for a, b in zip(default, emulated))
    moved = max((a - b).abs().max().item() for a, b in zip(emulated, plain))
    assert moved > 1e-2, moved  # MXFP4 activations are coarse: the toy's log-probabilities must show it

    weight_only = {mode: load(exports["w_mxfp4"], tmp_path / "wo", mode) for mode in ("emulate", "bf16")}
    assert weight_only["emulate"][0].quant_activations == "bf16"  # nothing to emulate for a weight-only scheme
    assert "weights only" in " ".join(weight_only["emulate"][2])
    assert all(torch.equal(a, b) for a, b in zip(logprobs(weight_only["emulate"][0]),
                                                 logprobs(weight_only["bf16"][0])))


def _reference(x: torch.Tensor, fmt: ActivationFormat) -> torch.Tensor:
    """quant.numerics' own quantize -> dequantize of x along its last dimension."""
    if fmt.kind == "mxfp4":
        return mxfp4.dequantize_mxfp4(*mxfp4.quantize_mxfp4(x, "even"), dtype=x.dtype)
    if fmt.kind == "mxfp8":
        return mxfp8.dequantize_mxfp8(*mxfp8.quantize_mxfp8(x, "even"), dtype=x.dtype)
    assert fmt.kind == "fp8-group"  # one FP8 scale per token and group of inputs (the last group may be short)
    parts = []
    for chunk in x.split(fmt.group, dim=-1):
        q, scale = fp8.quantize_fp8_per_channel(chunk.reshape(-1, chunk.shape[-1]))
        parts.append(fp8.dequantize_fp8(q, scale, dtype=x.dtype).reshape(chunk.shape))
    return torch.cat(parts, dim=-1)


@pytest.mark.parametrize("scheme,kind", [("w_mxfp4_a_mxfp4", "mxfp4"), ("fp8-block", "fp8-group"),
                                         ("w_mxfp8_a_mxfp8", "mxfp8")])
def test_each_hooked_input_is_the_numerics_qdq_of_the_bf16_input(exports, tmp_path, scheme, kind):
    """Inputs seen before the emulation hook (prepended) and after it, on every hooked linear and fused-experts
    module of the model: the second is quant.numerics' QDQ of the first, bit for bit."""
    ckpt = open_checkpoint(exports[scheme])
    formats = activation_formats(ckpt)
    assert formats and {f.kind for f in formats.values()} == {kind}
    model, _, _ = load(exports[scheme], tmp_path, "emulate")
    fmt = next(iter(formats.values()))
    seen: dict[str, list] = {}
    for name, module in model.named_modules():
        if module._forward_pre_hooks:  # the emulation's hook (transformers registers none of its own here)
            def before(m, args, kwargs, name=name):
                seen.setdefault(name, [None, None])[0] = (args[0] if args else kwargs["hidden_states"]).clone()

            def after(m, args, kwargs, name=name):
                seen[name][1] = (args[0] if args else kwargs["hidden_states"]).clone()

            module.register_forward_pre_hook(before, with_kwargs=True, prepend=True)
            module.register_forward_pre_hook(after, with_kwargs=True)
    logprobs(model)
    assert len(seen) >= 4, sorted(seen)
    if kind == "mxfp4":  # the default recipe quantizes the routed experts: transformers' fused experts module,
        experts = model.get_submodule("model.layers.1.mlp.experts")  # whose down_proj input is _apply_gate's output
        assert "model.layers.1.mlp.experts" in seen
        gate_up = torch.randn(5, 2 * experts.intermediate_dim, dtype=torch.bfloat16)
        plain = type(experts)._apply_gate(experts, gate_up)
        assert torch.equal(experts._apply_gate(gate_up), _reference(plain, fmt))
        assert not torch.equal(experts._apply_gate(gate_up), plain)
    changed = 0
    for name, (raw, emulated) in seen.items():
        assert raw.dtype == emulated.dtype == torch.bfloat16
        assert torch.equal(emulated, _reference(raw, fmt)), name
        changed += not torch.equal(raw, emulated)
    assert changed == len(seen)


def test_fp8_groups_pad_a_partial_group_and_formats_not_modelled_are_refused():
    x = torch.randn(3, 200, dtype=torch.bfloat16)
    out = qdq_activation(x, ActivationFormat("fp8-group", group=128))
    assert torch.equal(out, _reference(x, ActivationFormat("fp8-group", group=128)))
    assert torch.equal(out[:, 128:], _reference(x[:, 128:].contiguous(), ActivationFormat("fp8-group", group=72)))
    assert not torch.equal(out, _reference(x, ActivationFormat("fp8-group", group=100)))
    from quant.dequant import _input_format

    static = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False}
    with pytest.raises(QuantError, match=r"fp8_e4m3 per_tensor \(static\) are not modelled .*--activations bf16"):
        _input_format(static, "quantization_config.global_quant_config")
    odd_rule = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "scale_calculation_mode": "stochastic"}
    with pytest.raises(QuantError, match="activation scale rule 'stochastic' is not modelled"):
        _input_format(odd_rule, "quantization_config.global_quant_config")
    assert _input_format({**odd_rule, "scale_calculation_mode": None}, "x") == ActivationFormat("mxfp4", "even")
