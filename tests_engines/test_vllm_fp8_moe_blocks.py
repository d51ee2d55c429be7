"""The preflight's model of vLLM's block-FP8 FusedMoE scales (quant.verify.block_fp8.fp8_moe_scale_load, rule
"refine") against vLLM's own code over a grid of moe_intermediate_size, hidden_size and TP degree.

vLLM's functions run unmodified: fused_moe/oracle/fp8.py refine_fp8_moe_block_shape, quantization/fp8.py
Fp8MoEMethod.create_weights (the scale parameters it allocates; validate_fp8_block_shape_moe when nothing is
refined) and fused_moe/routed_experts.py RoutedExperts._load_model_weight_or_group_weight_scale / _load_w13 /
_load_w2 (narrowing and copying). What is stood in for: the TP world size (a constant instead of a process
group), the layer and MoE config objects (plain namespaces with the attributes those functions read) and the
four lines of RoutedExperts.weight_loader that upsample block scales by `weight_scale_refine`
(repeat_interleave on both dims), which need a whole layer to call.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from quant.verify.block_fp8 import fp8_moe_scale_load

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

GRID = [(inter, hidden, tp) for inter in (64, 96, 128, 160, 192, 256, 384, 768, 1536)
        for hidden in (96, 128, 160, 224, 256, 2048) for tp in (1, 2, 4, 8) if inter % tp == 0]


def _vllm_outcome(inter: int, hidden: int, tp: int, monkeypatch) -> str:
    import vllm.distributed as dist
    import vllm.model_executor.layers.quantization.fp8 as fp8
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import refine_fp8_moe_block_shape
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    monkeypatch.setattr(dist, "get_tensor_model_parallel_world_size", lambda: tp)
    monkeypatch.setattr(fp8, "get_tensor_model_parallel_world_size", lambda: tp, raising=False)
    block = [128, 128]
    ispp = inter // tp
    moe = SimpleNamespace(intermediate_size_per_partition=ispp, intermediate_size=inter, tp_size=tp,
                          hidden_dim=hidden, w13_num_shards=2, has_bias=False, is_act_and_mul=True,
                          tp_shard_with_padding=False, moe_parallel_config=SimpleNamespace(tp_size=tp))
    refined = refine_fp8_moe_block_shape(moe, block)
    method = SimpleNamespace(block_quant=True, weight_block_size=block, moe_block_shape=refined or block,
                             weight_scale_refine=None if refined is None else (128 // refined[0], 128 // refined[1]),
                             moe=moe, weight_scale_name="weight_scale_inv",
                             quant_config=SimpleNamespace(activation_scheme="dynamic"))
    layer = torch.nn.Module()
    try:
        fp8.Fp8MoEMethod.create_weights(method, layer, num_experts=1, hidden_size=hidden,
                                        intermediate_size_per_partition=ispp, params_dtype=torch.bfloat16)
    except ValueError as e:
        return f"ValueError: {e}"
    experts = SimpleNamespace(moe_config=moe, _load_w2=None, _load_w13=None)
    experts._get_hidden_dim = RoutedExperts._get_hidden_dim  # staticmethods
    experts._narrow_expert_data_for_padding = RoutedExperts._narrow_expert_data_for_padding
    experts._load_w2 = lambda **kw: RoutedExperts._load_w2(experts, **kw)
    experts._load_w13 = lambda **kw: RoutedExperts._load_w13(experts, **kw)
    up = method.weight_scale_refine or (1, 1)
    # Checkpoint order: down_proj (w2) before gate_proj (w1) and up_proj (w3).
    for shard, param, ckpt, shard_dim in (
            ("w2", layer.w2_weight_scale_inv, (math.ceil(hidden / 128), math.ceil(inter / 128)), 1),
            ("w1", layer.w13_weight_scale_inv, (math.ceil(inter / 128), math.ceil(hidden / 128)), 0),
            ("w3", layer.w13_weight_scale_inv, (math.ceil(inter / 128), math.ceil(hidden / 128)), 0)):
        loaded = torch.ones(ckpt).repeat_interleave(up[0], dim=-2).repeat_interleave(up[1], dim=-1)
        try:
            RoutedExperts._load_model_weight_or_group_weight_scale(
                experts, shard_dim=shard_dim, expert_data=param.data[0], shard_id=shard, loaded_weight=loaded,
                tp_rank=0, is_scale=True)
        except RuntimeError as e:
            return f"RuntimeError: {e}"
    return "loaded"


@pytest.mark.parametrize("inter,hidden,tp", GRID)
def test_refine_model_matches_vllm(inter, hidden, tp, monkeypatch):
    real = _vllm_outcome(inter, hidden, tp, monkeypatch)
    model = fp8_moe_scale_load("refine", inter, hidden, tp)
    if real == "loaded":
        assert not model.error, (real, model)
    elif real.startswith("ValueError"):
        assert model.at_build and real.split(": ", 1)[1] in model.error, (real, model)
    else:
        assert not model.at_build and real.split(": ", 1)[1] in model.error, (real, model)
