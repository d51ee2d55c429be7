"""Run by the SGLang tier (`make test-engines`, tests_engines/test_sglang.py) with the interpreter of .venv-sglang and,
for an older release, that release on PYTHONPATH (tests_engines/sglang_env.py): build the main model and the
NextN/MTP draft of one checkpoint with SGLang's own config parsing, module construction and weight loaders, and
compare every parameter SGLang holds with what the checkpoint means.

    python tests_engines/sglang_probe.py CHECKPOINT [--reference DEQUANTIZED_DIR] [--no-draft]

Prints one JSON line: {"release": "0.5.23", "models": {"main": R, "draft": R}} with, per model,
  outcome     "loaded" | "build-error" (the model class raised while being constructed) | "load-error" (its
              load_weights raised) | "loads-wrong" (it loaded, but a parameter holds other values than the
              checkpoint's, or was never written) | "absent" (no draft: the checkpoint has no MTP layer)
  error       "<exception type>: <first line>"
  module      build errors: the module being constructed (the innermost `prefix` of SGLang's constructors)
  tensor      load errors: the last checkpoint tensor SGLang's weight iterator handed to load_weights
  class       the model class SGLang chose (e.g. DeepseekV3ForCausalLMNextN for the draft)
  unwritten   parameters with a checkpoint source that still hold the sentinel after loading
  mismatched  parameters whose bytes differ from the checkpoint's (name, source tensors, share of elements)
  decoded     quantized parameters decoded independently (ml_dtypes: MXFP4 float4_e2m1fn x float8_e8m0fnu, FP8
              float8_e4m3fn x its per-tensor / per-channel / 128x128-block scale) from what SGLang holds and
              compared with quant.dequant's BF16 reading of the export (--reference): name -> {"format": "mxfp4" |
              "fp8" | "fp8-block", "diff": max |diff|} or {"format", "error"} (could not be decoded: a failure)
  checked / unmapped   parameters compared / parameters with no checkpoint source (module defaults: k_scale, ...)

What SGLang holds is read after its weight loaders ran (`model.load_weights`, which for DeepSeek/GLM includes
their own `post_load_weights`); `process_weights_after_loading` of the quant methods is then run as the engine does
and its failure is reported under "postprocess" only (the Quark MXFP4 MoE repacking needs ROCm's aiter, not
available on CPU; it is a kernel-preparation step, not a loader).

SGLang is not patched. What the shim (`install_shim`) replaces, and nothing else:
  - `torchvision`: a stub package (attributes are inert classes). SGLang and transformers import it for image
    preprocessing only; the registry's torchvision does not import beside the local CPU torch 2.13 build.
  - `vllm` / `vllm._custom_ops`: a stub whose functions raise if called. RotaryEmbedding.__init__ imports
    `rotary_embedding` from it on a platform that is neither CUDA nor HIP; it is used in forward only.
  - Device capability (9, 0) from `torch.cuda.get_device_capability` and `sglang.srt.utils.common.
    get_device_capability` (QuarkConfig's scheme check and the loader's capability check assert on it; DSA
    server-argument resolution reads it). ServerArgs says device "cuda" so SGLang takes its GPU code paths
    (on "cpu" it picks CPU-only rope/attention classes), while every tensor is allocated on the CPU.
  - `torch.cuda.Stream` on a torch without CUDA: an inert stand-in (any use of it raises). SGLang 0.5.23's Kimi-K3
    creates three side streams while building its language model (models/kimi_k3.py:2761, on every non-HIP
    platform), which a CPU torch refuses ("torch.cuda.Stream requires CUDA support"); they are used in forward only.
  - Distributed state for world size 1 (gloo), as SGLang's own layer tests set it up (sglang.test.
    layer_ut_utils.init_single_process_dist for 0.5.23; ModelRunner.init_torch_distributed's calls for 0.5.12).
`SGLANG_USE_CPU_ENGINE` stays unset: it switches the loaders to a branch that pads and narrows mismatched tensors
(narrow_padded_param_and_loaded_weight), hiding exactly the errors this probe looks for.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import os
import re
import sys
import time
import traceback
import types

os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# --- the shim -----------------------------------------------------------------------------------------------------

class _AnyMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _inert(name)


def _inert(name):
    def call(*args, **kwargs):
        raise RuntimeError(f"stub {name} called (the SGLang probe's shim has no kernels)")
    return _AnyMeta(name, (), {"__init__": lambda self, *a, **k: None, "__call__": call})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _inert(name)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    ROOTS = {"torchvision", "vllm"}

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.ROOTS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__, module.__file__ = [], "<sglang_probe stub>"
        module.__version__ = "0.28.0"
        return module

    def exec_module(self, module):
        pass


class _InertStream:
    """A CUDA stream that can be created but not used (the shim's stand-in on a torch without CUDA)."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        raise RuntimeError(f"the SGLang probe's inert CUDA stream has no {name} (no kernels on CPU)")


def install_shim():
    sys.meta_path.insert(0, _StubFinder())
    import torch

    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    if not torch.cuda.is_available():
        torch.cuda.Stream = _InertStream
    import sglang.srt.utils.common as common

    common.get_device_capability = lambda device_id=0: (9, 0)
    for module in ("sglang.srt.model_loader.loader", "sglang.srt.layers.quantization.quark.quark",
                   "sglang.srt.utils"):
        mod = sys.modules.get(module) or __import__(module, fromlist=["_"])
        if hasattr(mod, "get_device_capability"):
            mod.get_device_capability = common.get_device_capability


def init_distributed(server_args, release):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
    from sglang.srt.distributed import parallel_state as ps

    if release >= (0, 5, 20):
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
        from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish

        publish(server_args, role="test", ranks=SpawnRanks(world_rank=0))
        get_parallel().override_permanently(world_group=ps._WORLD)
        ps.initialize_model_parallel(backend="gloo")
    else:
        from sglang.srt.server_args import set_global_server_args_for_scheduler

        set_global_server_args_for_scheduler(server_args)
        ps.init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                        distributed_init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}")
        ps.initialize_model_parallel(tensor_model_parallel_size=1, backend="gloo")


# --- checkpoint side ------------------------------------------------------------------------------------------------

FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"],
         "fused_qkv_a_proj_with_mqa": ["q_a_proj", "kv_a_proj_with_mqa"],
         "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"], "in_proj_ba": ["in_proj_b", "in_proj_a"],
         "index_qkv_proj": ["index_q_proj", "index_k_proj"],
         # Kimi-K3 (kimi_k3.py KimiK3ForConditionalGeneration.packed_modules_mapping, 0.5.23 :3450-3465)
         "fused_qkvg_proj": ["q_proj", "k_proj", "v_proj", "g_proj"],
         "qkv_conv1d": ["q_conv1d", "k_conv1d", "v_conv1d"],  # MiniMax-M3 (minimax_m3_vl.py packed_modules_mapping)
         # GLM-5.3-Flash's BF16 KDA projections (glm5_next.py Glm5NextLinearAttention._PACKED_MODULES_MAPPING
         # :344-355; fused_fg_b_proj is a ColumnParallelBatchedLinear holding f_b and g_b as [2, out, in])
         "fused_qkvbfg_a_proj": ["q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "g_a_proj"],
         "fused_bfg_a_proj": ["b_proj", "f_a_proj", "g_a_proj"], "fused_fg_b_proj": ["f_b_proj", "g_b_proj"]}
# Fused modules holding their shards stacked ([shards, out, in]) rather than concatenated along the rows.
STACKED = {"fused_fg_b_proj"}
# Per-expert checkpoint leaves of a FusedMoE's w13 (gate, up) and w2 (down): Qwen/DeepSeek/GLM/Kimi name them
# gate_proj / up_proj / down_proj, MiniMax-M2/M3 w1 / w3 / w2 (FusedMoE.make_expert_params_mapping in their models).
EXPERT_LEAVES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


class Checkpoint:
    def __init__(self, path):
        from safetensors import safe_open

        self.path = path
        self.files = {}
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            for name, shard in json.load(open(index))["weight_map"].items():
                self.files[name] = os.path.join(path, shard)
        else:
            for f in sorted(os.listdir(path)):
                if f.endswith(".safetensors"):
                    with safe_open(os.path.join(path, f), "pt") as h:
                        for name in h.keys():
                            self.files[name] = os.path.join(path, f)
        self._open = {}

    def __contains__(self, name):
        return name in self.files

    def get(self, name):
        from safetensors import safe_open

        f = self.files[name]
        if f not in self._open:
            self._open[f] = safe_open(f, "pt")
        return self._open[f].get_tensor(name)


def _leaf_sources(ckpt, module_names, leaf):
    """Checkpoint names for `module.leaf` over candidate module names; fused modules concatenate their shards."""
    for module in module_names:
        if f"{module}.{leaf}" in ckpt:
            return [f"{module}.{leaf}"]
        head, _, last = module.rpartition(".")
        if last in FUSED:
            parts = [f"{head}.{s}.{leaf}" for s in FUSED[last]]
            present = [p for p in parts if p in ckpt]
            if present:
                return present
        if last == "ngram_embedding":  # Qwen4-Exp's PLE table, stored as split_ngram_parts row shards (SGLang
            # qwen4_exp.py load_qwen4_exp_ple_shard places shard j at row j * ceil(rows / parts): their concatenation)
            shards = []
            while f"{module}.shard_{len(shards)}.{leaf}" in ckpt:
                shards.append(f"{module}.shard_{len(shards)}.{leaf}")
            if shards:
                return shards
    return None


def _stored_leaves(suffix):
    """Checkpoint leaves an expert parameter leaf may be loaded from: compressed-tensors MXFP4 stores `weight_packed`,
    which SGLang 0.5.23's Kimi-K3 loader renames to `weight` for Mxfp4MoEMethod (models/kimi_k3.py:3207-3210)."""
    return (suffix, "weight_packed") if suffix == "weight" else (suffix,)


def expert_sources(ckpt, module_names, leaf):
    """FusedMoE parameters: w13_<x> [E, 2I, ...] = per expert cat(gate, up); w2_<x> = per expert down. Returns
    (rows of source names, stacked) where stacked means one row per expert."""
    m = re.match(r"(w13|w2)_(.*)$", leaf)
    if not m:
        return None, False
    which, suffix = m.groups()
    for module in module_names:
        for (gate, up, down), stored in [(leaves, s) for leaves in EXPERT_LEAVES for s in _stored_leaves(suffix)]:
            rows = []
            for e in range(4096):
                if which == "w13":
                    parts = [f"{module}.{e}.{p}.{stored}" for p in (gate, up)]
                else:
                    parts = [f"{module}.{e}.{down}.{stored}"]
                if not all(p in ckpt for p in parts):
                    break
                rows.append(parts)
            if rows:
                return rows, True
        fused = f"{module}.{'gate_up_proj' if which == 'w13' else 'down_proj'}"
        if suffix == "weight" and fused in ckpt:
            return [[fused]], False
    return None, False


def expert_value(ckpt, rows, stacked):
    import torch

    tensors = [torch.cat([ckpt.get(p) for p in parts], 0) if len(parts) > 1 else ckpt.get(parts[0])
               for parts in rows]
    return torch.stack(tensors) if stacked else tensors[0]


def candidate_modules(module, draft, mtp_index):
    """Checkpoint module names a SGLang module name may have been loaded from: the NextN draft's model.decoder /
    model.{eh_proj,enorm,hnorm,shared_head} (DeepSeek/GLM: model.layers.{N}.*), the Qwen3.5 draft's mtp.*, the
    Qwen3.5 wrapper's model.language_model.* / model.visual.*, and Qwen3-Next-style attention modules SGLang builds
    directly on the decoder layer (checkpoint: layers.{i}.self_attn.*)."""
    out = [module]
    if draft:
        n = mtp_index
        for layer in (f"model.layers.{n}.", f"model.language_model.layers.{n}."):  # GLM-5.3-Flash: the wrapper's
            if module.startswith("model.decoder."):
                out.append(layer + module[len("model.decoder."):])
            if module.startswith("model.") and not module.startswith("model.layers."):
                out.append(layer + module[len("model."):])
        out.append(module.replace("model.layers.0.", f"model.layers.{n}.", 1))
        if module.startswith("model."):
            out.append("mtp." + module[len("model."):])
        out.append("mtp." + module)
    for prefix, ck in (("language_model.model.", "model.language_model."), ("language_model.", ""),
                       ("model.", "model.language_model."), ("visual.", "model.visual."),
                       # Kimi-K2.5 / MiniMax-M3: the text model held as model.*, built as language_model.model.*
                       ("model.", "language_model.model."), ("lm_head", "language_model.lm_head")):
        if module.startswith(prefix):
            out.append(ck + module[len(prefix):])
    # GLM-5.3-Flash's vision attention: the mapper's suffix rule .attn.qkv -> .attn.qkv_proj (glm5_next.py:1239)
    out += [m[: -len("_proj")] for m in list(out) if m.startswith("model.visual.") and m.endswith(".attn.qkv_proj")]
    # MiniMax-M3 (SGLang 0.5.23) builds its MoE as layers.N.mlp: the checkpoint's layers.N.block_sparse_moe
    out += [m.replace(".mlp.", ".block_sparse_moe.", 1) for m in list(out) if ".mlp." in m]
    out += [m[: -len(".mlp")] + ".block_sparse_moe" for m in list(out) if m.endswith(".mlp")]
    # (Qwen4-Exp's QSA indexer too: checkpoint layers.{i}.self_attn.indexer.*, SGLang layers.{i}.indexer.*)
    m = re.match(r"(.*\.layers\.\d+)\.(qkv_proj|o_proj|q_norm|k_norm|q_proj|k_proj|v_proj|indexer\.\w+)$", module)
    if m:
        out += [f"{c}" for c in candidate_modules(f"{m.group(1)}.self_attn.{m.group(2)}", draft, mtp_index)]
    return out


# The reference of a fused expert parameter whose checkpoint experts disagree in shape: whatever SGLang writes
# there is a wrong load (it kept part of a tensor, or left zeros where a tensor was short).
INCONSISTENT = "inconsistent"

# Draft parameters SGLang shares with the target model instead of loading them (deepseek_nextn.py / glm4_moe.py
# skip embed_tokens and shared_head.head; set_embed_and_head at runtime).
DRAFT_SHARED = {"model.embed_tokens.weight", "lm_head.weight"}


def expected(ckpt, name, draft, mtp_index):
    import torch

    module, _, leaf = name.rpartition(".")
    modules = candidate_modules(module, draft, mtp_index)
    if draft and name in DRAFT_SHARED:
        return None, None  # the draft takes these from the target model (set_embed_and_head)
    rows, stacked = expert_sources(ckpt, modules, leaf)
    if rows:
        srcs = [p for parts in rows[:1] for p in parts] + ([f"... {len(rows)} experts"] if stacked else [])
        try:
            return expert_value(ckpt, rows, stacked), srcs
        except RuntimeError:  # experts of different shapes (a broken export): no load of them can be right
            return INCONSISTENT, [p for parts in rows for p in parts]

    srcs = _leaf_sources(ckpt, modules, leaf)
    if not srcs:
        return None, None
    tensors = [ckpt.get(s) for s in srcs]
    if module.rpartition(".")[2] in STACKED:
        return torch.stack(tensors), srcs
    value = torch.cat(tensors, 0) if len(tensors) > 1 else tensors[0]
    return value, srcs


# --- comparison -----------------------------------------------------------------------------------------------------

def _raw(t):
    import torch

    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, getattr(torch, "float8_e8m0fnu", None)):
        return t.view(torch.uint8)
    return t


def fill_sentinel(param):
    import torch

    with torch.no_grad():
        if param.dtype.is_floating_point and param.element_size() > 1:
            param.data.fill_(float("nan"))
        elif param.element_size() == 1:
            param.data.view(torch.uint8).fill_(0xFF if param.dtype == torch.uint8 else 0x7F)
        else:
            param.data.fill_(-1)


def is_sentinel(param):
    import torch

    with torch.no_grad():
        if param.dtype.is_floating_point and param.element_size() > 1:
            return torch.isnan(param.data)
        if param.element_size() == 1:
            return param.data.view(torch.uint8) == (0xFF if param.dtype == torch.uint8 else 0x7F)
        return param.data == -1


def _all_sentinel_value(value):
    import torch

    if value.dtype.is_floating_point and value.element_size() > 1:
        return torch.isnan(value).all()
    return torch.tensor(False)


def compare(param, value, padded=False, name_leaf=""):
    """Share of elements that differ (1.0 when the shapes differ)."""
    import torch

    held = param.data
    if (held.dim() == value.dim() == 2 and held.shape[1] == value.shape[1] and held.shape[0] > value.shape[0]
            and padded):
        held = held[: value.shape[0]]  # vocabulary rows padded by VocabParallelEmbedding / ParallelLMHead
    if name_leaf == "A_log" and held.dim() == 4 and value.dim() == 1 and value.numel() > held.numel():
        # Kimi-K3 stores A_log padded to head_dim; SGLang 0.5.23's _a_log_weight_loader keeps its first num_heads
        # entries (models/kimi_k3.py:1732-1752)
        value = value[: held.numel()]
    if tuple(held.shape) != tuple(value.shape) and held.numel() == value.numel() and \
            [d for d in held.shape if d != 1] == [d for d in value.shape if d != 1]:
        value = value.reshape(held.shape)  # singleton axes (conv1d weights)
    if tuple(held.shape) != tuple(value.shape):
        return 1.0
    if held.dtype != value.dtype:
        if held.element_size() == 1 or value.element_size() == 1:
            if held.element_size() != value.element_size():
                return 1.0
            held, value = _raw(held), _raw(value)
            if held.dtype != value.dtype:
                held, value = held.view(torch.uint8), value.view(torch.uint8)
        else:
            value = value.to(held.dtype)
    held, value = _raw(held), _raw(value)
    if held.dtype.is_floating_point:
        diff = ~((held == value) | (torch.isnan(held) & torch.isnan(value)))
    else:
        diff = held != value
    return float(diff.float().mean()) if diff.numel() else 0.0


def _sglang_mxfp4_decoder():
    """SGLang's own MXFP4 dequantization where the release has one: 0.5.23's Quark W4A4 scheme dequantizes a packed
    weight on CPU-capable code (quark/schemes/quark_w4a4_mxfp4.py:140-160 `_dequant_mxfp4_to_bf16`: low nibble to
    the even element, its E2M1 table, 2^(b-127) scales, 32 per block). 0.5.12 has none (its MXFP4 paths are
    aiter/triton kernels), and gets ml_dtypes' E2M1/E8M0 types in the same unpacking order."""
    try:
        from sglang.srt.layers.quantization.quark.schemes.quark_w4a4_mxfp4 import _dequant_mxfp4_to_bf16
    except ImportError:
        return None
    return _dequant_mxfp4_to_bf16


MXFP4_DECODER = "ml_dtypes"


def decode_mxfp4(packed, scale):
    """The MXFP4 weight SGLang holds, decoded by SGLang's own dequantization (else ml_dtypes'): float32."""
    global MXFP4_DECODER
    import torch

    sglang_decode = _sglang_mxfp4_decoder()
    if sglang_decode is not None:
        MXFP4_DECODER = "sglang:_dequant_mxfp4_to_bf16"
        rows = packed.contiguous().reshape(-1, packed.shape[-1])
        out = sglang_decode(rows, scale.contiguous().reshape(-1, scale.shape[-1]))
        return out.to(torch.float32).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    import ml_dtypes
    import numpy as np

    p = packed.contiguous().numpy()
    codes = np.stack([p & 0xF, p >> 4], -1).reshape(*p.shape[:-1], p.shape[-1] * 2)
    values = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    scales = scale.contiguous().numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    out = values.reshape(*p.shape[:-1], -1, 32) * scales[..., None]
    return torch.from_numpy(out.reshape(*p.shape[:-1], -1).astype(np.float32))


# --- the run --------------------------------------------------------------------------------------------------------

def _first_line(e):
    message = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {message}"[:500]


def _innermost_prefix(tb):
    prefix = None
    while tb is not None:
        p = tb.tb_frame.f_locals.get("prefix")
        if isinstance(p, str) and p:
            prefix = p
        tb = tb.tb_next
    return prefix


def init_dp_attention(server_args, release, ckpt_path):
    if release < (0, 5, 20):  # ModelRunner.init_torch_distributed's third call in 0.5.12
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.layers.dp_attention import initialize_dp_attention

        initialize_dp_attention(server_args=server_args,
                                model_config=ModelConfig.from_server_args(server_args, model_path=ckpt_path))


def _names_in_trace(tb, param_names=None):
    """Tensor/parameter names held in local variables of the failing frames, outermost first; `param_names`
    (id -> name) also names the parameters the failing frames were writing, and every parameter the innermost
    frame holding any held (0.5.12's post_load_weights raises holding kv_b_proj's weight and weight_scale under
    other local names)."""
    seen, innermost = [], []
    while tb is not None:
        for key in ("param", "parameter"):
            v = tb.tb_frame.f_locals.get(key)
            if param_names and id(v) in param_names and param_names[id(v)] not in seen:
                seen.append(param_names[id(v)])
        for key in ("name", "weight_name", "param_name", "ckpt_name", "loaded_name"):
            v = tb.tb_frame.f_locals.get(key)
            if isinstance(v, str) and "." in v and v not in seen:
                seen.append(v)
        held = [param_names[id(v)] for v in tb.tb_frame.f_locals.values() if param_names and id(v) in param_names]
        innermost = held or innermost
        tb = tb.tb_next
    return seen + [n for n in innermost if n not in seen]


def run_model(ckpt_path, ckpt, draft, reference, mtp_index):
    import torch

    import sglang.srt.model_loader.loader as L
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.utils import get_model_architecture

    result = {}
    server_args = SERVER_ARGS
    try:
        model_config = ModelConfig.from_server_args(server_args, model_path=ckpt_path, is_draft_model=draft)
        load_config = LoadConfig(load_format="auto")
        result["class"] = get_model_architecture(model_config)[0].__name__
        quant_config = L._get_quantization_config(model_config, load_config)
        with L.set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
            model = L._initialize_model(model_config, load_config, quant_config)
    except Exception as e:  # the outcome under test
        return {**result, "outcome": "build-error", "error": _first_line(e),
                "module": _innermost_prefix(e.__traceback__), "trace": traceback.format_exc()[-3000:]}
    params = dict(model.named_parameters())
    sources = {}
    for name, param in params.items():
        value, srcs = expected(ckpt, name, draft, mtp_index)
        if value is not None:
            sources[name] = (value, srcs)
            fill_sentinel(param)
    loader = L.DefaultModelLoader(load_config)
    last = {"name": None}

    def tracked(weights):
        for name, tensor in weights:
            last["name"] = name
            yield name, tensor

    try:
        with L.set_default_torch_dtype(model_config.dtype):
            model.load_weights(tracked(loader._get_all_weights(model_config, model)))
    except Exception as e:
        names = _names_in_trace(e.__traceback__, {id(p): n for n, p in params.items()})
        return {**result, "outcome": "load-error", "error": _first_line(e),
                "tensor": names[0] if names else last["name"], "names": names, "last_read": last["name"],
                "module": _innermost_prefix(e.__traceback__), "trace": traceback.format_exc()[-3000:]}
    unwritten, mismatched = [], []
    for name, (value, srcs) in sources.items():
        param = params[name]
        if isinstance(value, str):  # INCONSISTENT: the load went through, so it read the experts wrongly
            mismatched.append({"param": name, "sources": srcs, "share": 1.0, "held": [list(param.shape),
                               str(param.dtype)], "expected": "experts of different shapes in the checkpoint"})
            continue
        if bool(is_sentinel(param).all()) and value.numel() and not bool(_all_sentinel_value(value)):
            unwritten.append(name)
            continue
        share = compare(param, value, padded=name.endswith(("embed_tokens.weight", "lm_head.weight")),
                        name_leaf=name.rpartition(".")[2])
        if share:
            mismatched.append({"param": name, "sources": srcs, "share": round(share, 4),
                               "held": [list(param.shape), str(param.dtype)],
                               "expected": [list(value.shape), str(value.dtype)]})
    result.update(unwritten=unwritten, mismatched=mismatched, checked=len(sources),
                  unmapped=sorted(set(params) - set(sources)))
    if reference:
        result["decoded"] = decode_against_reference(params, sources, reference, draft, mtp_index)
    try:
        for module in model.modules():  # DefaultModelLoader.load_weights_and_postprocess's second half
            quant_method = getattr(module, "quant_method", None)
            if quant_method is not None:
                quant_method.process_weights_after_loading(module)
        result["postprocess"] = "ok"
    except Exception as e:
        result["postprocess"] = _first_line(e)
    result["outcome"] = "loads-wrong" if unwritten or mismatched else "loaded"
    return result


def decode_fp8(weight, scale, block=None, shard_rows=None):
    """Independent FP8 decode (ml_dtypes float8_e4m3fn -> float32, times the float32 scale, rounded to BF16 as
    quant.dequant rounds): per tensor (scale of one element), per channel (one scale per row: [out], [out, 1]; an
    expert stack [E, out] / [E, out, 1]) or, with `block`, per block x block tile of weight_scale_inv, each fused
    shard (`shard_rows`: its rows, in order) starting its own tile rows as SGLang's merged loaders place them."""
    import ml_dtypes
    import numpy as np
    import torch

    w = weight.contiguous().view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    s = scale.detach().to(torch.float32).contiguous().numpy()
    if block is None:
        if s.size == 1:
            out = w * s.reshape(())
        else:
            s = s.reshape(*w.shape[:-1], 1)
            out = w * s
    else:
        rows = shard_rows or [w.shape[-2]]
        parts, tile = [], 0
        for r, start in zip(rows, np.cumsum([0] + rows[:-1])):
            n = -(-r // block)
            grid = s[..., tile:tile + n, :]
            full = np.repeat(np.repeat(grid, block, axis=-2), block, axis=-1)[..., :r, :w.shape[-1]]
            parts.append(w[..., start:start + r, :] * full)
            tile += n
        if tile != s.shape[-2]:
            raise ValueError(f"weight_scale_inv has {s.shape[-2]} tile rows, the shards {rows} need {tile}")
        out = np.concatenate(parts, axis=-2)
    return torch.from_numpy(np.ascontiguousarray(out)).to(torch.bfloat16)


def _quantized_format(name, param, params):
    """("mxfp4" | "fp8" | "fp8-block", scale parameter name) for a quantized weight SGLang holds, else None."""
    import torch

    if param.dtype == torch.uint8 and params.get(name + "_scale") is not None \
            and params[name + "_scale"].dtype == torch.uint8:
        return "mxfp4", name + "_scale"
    if param.dtype == torch.float8_e4m3fn:
        if name + "_scale_inv" in params:
            return "fp8-block", name + "_scale_inv"
        if name + "_scale" in params:
            return "fp8", name + "_scale"
    return None


def decode_against_reference(params, sources, reference_path, draft, mtp_index):
    """For each quantized weight SGLang holds (MXFP4: uint8 packed + uint8 weight_scale; FP8: float8_e4m3fn +
    weight_scale (per tensor / channel) or weight_scale_inv (128x128 blocks)), decode it independently (ml_dtypes)
    and compare with the BF16 the export means (quant.dequant's output, same names as the source tensors):
    name -> {"format", "diff": max |decoded - reference|} or {"format", "error"} when it cannot be decoded or
    compared (a test failure, never skipped). Quantized parameters with no checkpoint source are not listed
    ("unmapped" counts them)."""
    import torch

    ref = Checkpoint(reference_path)
    out = {}
    for name, param in params.items():
        if name not in sources or name.endswith(("_scale", "_scale_inv")):
            continue
        kind = _quantized_format(name, param, params)
        if kind is None:
            continue
        fmt, scale_name = kind
        scale = params[scale_name]
        srcs = sources[name][1]
        try:
            module, _, leaf = name.rpartition(".")
            if re.match(r"w(13|2)_", leaf):
                rows, stacked = expert_sources(ref, candidate_modules(module, draft, mtp_index), leaf)
                if not rows:
                    raise KeyError(f"no reference tensors for {name}")
                value = expert_value(ref, rows, stacked)
                shard_rows = [ref.get(p).shape[0] for p in rows[0]]
            else:
                tensors = [ref.get(s) for s in srcs]
                value = torch.cat(tensors, 0)
                shard_rows = [t.shape[0] for t in tensors]
            if fmt == "mxfp4":
                if scale.shape[-1] * 16 != param.shape[-1]:
                    raise ValueError(f"packed {tuple(param.shape)} and scale {tuple(scale.shape)} disagree")
                decoded = decode_mxfp4(param.data, scale.data)
            else:
                decoded = decode_fp8(param.data, scale.data, 128 if fmt == "fp8-block" else None, shard_rows)
            if decoded.shape != value.shape:
                raise ValueError(f"decoded {tuple(decoded.shape)}, reference {tuple(value.shape)}")
            out[name] = {"format": fmt, "diff": float((decoded.float() - value.float()).abs().max())}
        except Exception as e:  # reported: the tier fails on it
            out[name] = {"format": fmt, "error": _first_line(e)}
    return out


SERVER_ARGS = None


def preload() -> None:
    """What the zygote (zygote.py) imports once before forking a child per checkpoint: the shim and SGLang's
    loader, model config and server args (each child sets up its own process group and server args)."""
    install_shim()
    import sglang.srt.model_loader.loader  # noqa: F401
    from sglang.srt.configs.model_config import ModelConfig  # noqa: F401
    from sglang.srt.server_args import ServerArgs  # noqa: F401


def main() -> int:
    global SERVER_ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("--reference", default=None)
    parser.add_argument("--no-draft", action="store_true")
    args = parser.parse_args()
    started = time.time()
    install_shim()
    import sglang
    from sglang.srt.server_args import ServerArgs

    release = tuple(int(x) for x in re.findall(r"\d+", sglang.__version__)[:3])
    config = json.load(open(os.path.join(args.checkpoint, "config.json")))
    text = config.get("text_config", config)
    mtp_layers = text.get("num_nextn_predict_layers") or text.get("mtp_num_hidden_layers") or 0
    mtp_index = text.get("num_hidden_layers", 0)
    kwargs = dict(model_path=args.checkpoint, device="cuda", tp_size=1, dtype="bfloat16",
                  disable_radix_cache=True, trust_remote_code=False)
    if mtp_layers and not args.no_draft:
        kwargs["speculative_algorithm"] = "NEXTN"
    try:
        SERVER_ARGS = ServerArgs(**kwargs)
        init_distributed(SERVER_ARGS, release)
        init_dp_attention(SERVER_ARGS, release, args.checkpoint)
    except Exception as e:
        print(json.dumps({"release": sglang.__version__, "setup-error": _first_line(e),
                          "trace": traceback.format_exc()[-3000:]}))
        return 0
    ckpt = Checkpoint(args.checkpoint)
    models = {"main": run_model(args.checkpoint, ckpt, False, args.reference, mtp_index)}
    if mtp_layers and not args.no_draft:
        models["draft"] = run_model(args.checkpoint, ckpt, True, args.reference, mtp_index)
    else:
        models["draft"] = {"outcome": "absent"}
    print(json.dumps({"release": sglang.__version__, "models": models, "mxfp4_decoder": MXFP4_DECODER,
                      "seconds": round(time.time() - started, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
