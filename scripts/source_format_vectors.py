"""Write the bit-exact source-format vectors of tests/data/source_formats/ from the formats' own reference code
(issue #31): compressed-tensors' MXFP4/NVFP4 compressors (compress and decompress), vLLM's MXFP8 quantizer and
dequantizer, and vLLM's DeepSeek-V4.1 32x32 MXFP8 scale loader. Run it in the engines venv, once:

    .venv-engines/bin/python scripts/source_format_vectors.py tests/data/source_formats

It writes vectors.safetensors (inputs and the references' outputs) and vectors.json (the compressed-tensors
config.json quantization_config each export got, and the versions that produced them). tests/test_source_formats.py
checks quant.sources' decoders against them without those packages; tests_engines/test_source_formats_reference.py
checks them against the packages themselves on fresh data."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch


def ct_export(scheme_name: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict]:
    """One Linear quantized with a compressed-tensors preset scheme, its scales from compressed-tensors' own
    observer math, compressed and saved by ModelCompressor: (its tensors, config.json's quantization_config)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp, generate_gparam

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            self.lm_head = torch.nn.Linear(weight.shape[1], 16, bias=False)

    model = Tiny().to(torch.bfloat16)
    model.proj.weight.data.copy_(weight)
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(scheme_name, ["Linear"])},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    module, args = model.proj, model.proj.quantization_scheme.weights
    global_scale = None
    if hasattr(module, "weight_global_scale"):
        global_scale = generate_gparam(weight.amin(), weight.amax())
        module.weight_global_scale.data.copy_(global_scale.reshape(module.weight_global_scale.shape))
    scale, _ = compute_dynamic_scales_and_zp(weight, args, module, global_scale=global_scale)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text("{}")
        compressor.update_config(d)
        qc = json.loads((Path(d) / "config.json").read_text())["quantization_config"]
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if k.startswith("proj.")}
    return state, qc


def ct_decompress(compressor, state: dict[str, torch.Tensor], scheme_name: str) -> torch.Tensor:
    from compressed_tensors.quantization import preset_name_to_scheme

    local = {k.split(".", 1)[1]: v for k, v in state.items()}
    return compressor.decompress(local, preset_name_to_scheme(scheme_name, ["Linear"]))["weight"]


def main(out: Path) -> None:
    import compressed_tensors
    import vllm
    from compressed_tensors.compressors import MXFP4PackedCompressor, NVFP4PackedCompressor
    from vllm.model_executor.layers.quantization.modelopt import CkptCtx, KMxfp8Static
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import (_mxfp8_e4m3_quantize_torch,
                                                                           dequant_mxfp8_to_bf16)

    g = torch.Generator().manual_seed(31)
    weight = (torch.randn(32, 64, generator=g) * torch.logspace(-3, 1, 64)).to(torch.bfloat16)
    weight[3, :32] = 0  # an all-zero block
    vectors: dict[str, torch.Tensor] = {"weight": weight}
    meta = {"generated_by": "scripts/source_format_vectors.py", "compressed_tensors": compressed_tensors.__version__,
            "vllm": vllm.__version__, "torch": torch.__version__, "quantization_config": {}}

    # compressed-tensors MXFP4 / NVFP4: a real compress of `weight`, and every byte value decoded.
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(8, 32)
    for tag, scheme, compressor in (("ct_mxfp4", "MXFP4A16", MXFP4PackedCompressor),
                                    ("ct_nvfp4", "NVFP4A16", NVFP4PackedCompressor)):
        state, qc = ct_export(scheme, weight)
        meta["quantization_config"][tag] = qc
        for k, v in state.items():
            vectors[f"{tag}.{k}"] = v
        vectors[f"{tag}.decoded"] = ct_decompress(compressor, state, scheme)
        if tag == "ct_mxfp4":
            scales = torch.randint(100, 150, (8, 2), generator=g, dtype=torch.int32).to(torch.uint8)
            extra = {"proj.weight_packed": every_byte, "proj.weight_scale": scales}
        else:
            scales = (torch.rand(8, 4, generator=g) * 400 + 0.01).to(torch.float8_e4m3fn)
            extra = {"proj.weight_packed": every_byte, "proj.weight_scale": scales,
                     "proj.weight_global_scale": torch.tensor([37.0], dtype=torch.float32)}
        for k, v in extra.items():
            vectors[f"{tag}_bytes.{k}"] = v
        vectors[f"{tag}_bytes.decoded"] = ct_decompress(compressor, extra, scheme)

    # MXFP8 [1, 32] (MiniMax-M3's layout): vLLM's quantizer and its dequantizer; every finite E4M3 byte decoded.
    q, s = _mxfp8_e4m3_quantize_torch(weight)
    vectors.update({"mxfp8.weight": q, "mxfp8.weight_scale_inv": s, "mxfp8.decoded": dequant_mxfp8_to_bf16(q, s)})
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)] + [0, 0], dtype=torch.uint8).reshape(8, 32)
    scales = torch.randint(100, 150, (8, 1), generator=g, dtype=torch.int32).to(torch.uint8)
    fp8 = codes.view(torch.float8_e4m3fn)
    vectors.update({"mxfp8_bytes.weight": fp8, "mxfp8_bytes.weight_scale_inv": scales,
                    "mxfp8_bytes.decoded": dequant_mxfp8_to_bf16(fp8, scales)})

    # UE8M0 32x32 FP8 (DeepSeek-V4.1's dense layers): vLLM's scale loader for a (32, 32) checkpoint block
    # (KMxfp8Static.get_scale_weight_loader: rows repeated) then its MXFP8 dequantizer.
    q32 = (torch.randn(64, 96, generator=g) * 100).to(torch.float8_e4m3fn)
    s32 = torch.randint(110, 140, (2, 3), generator=g, dtype=torch.int32).to(torch.uint8)
    expanded = torch.empty(64, 3, dtype=torch.uint8)
    loader = KMxfp8Static.get_scale_weight_loader(lambda param, w: param.copy_(w), CkptCtx(scale_block_size=(32, 32)))
    loader(expanded, s32.view(torch.float8_e8m0fnu))
    vectors.update({"ue8m0_32.weight": q32, "ue8m0_32.scale": s32.view(torch.float8_e8m0fnu),
                    "ue8m0_32.decoded": dequant_mxfp8_to_bf16(q32, expanded)})

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.clone().contiguous() for k, v in sorted(vectors.items())}, str(out / "vectors.safetensors"),
              metadata={"generated_by": meta["generated_by"]})
    (out / "vectors.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    print(f"wrote {len(vectors)} tensors to {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
