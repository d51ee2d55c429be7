"""Everything quantize would refuse halfway is refused before OUT holds a byte (issue #49 item 1): one read of every
scale tensor of the source (never a weight), for every source format, exit 2 naming the shard and the tensor.

Each case damages a tensor of the source's LAST shard, where the run used to get to only after writing the
others (or to write everything and fail its self-check, or to publish an export of zeros or NaN)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quant.errors import QuantError
from quant.pipeline import quantize_checkpoint
from quant.toy import build_toy
from quant.validate import require_sound_scales
from quant.checkpoint import open_checkpoint


def damaged(src: Path, dst: Path, suffix: str, how: str) -> str:
    """A copy of `src` whose last-sorted tensor ending in `suffix`, in the last shard holding one, is damaged:
    "drop" (removed, from the index too), "ff" (first byte 0xFF), "zero" (all zeros), "nan" / "inf" (first value).
    Returns its name."""
    shutil.copytree(src, dst)
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    names = sorted(n for n in index["weight_map"] if n.endswith(suffix))
    last_file = max(index["weight_map"][n] for n in names)
    name = [n for n in names if index["weight_map"][n] == last_file][-1]
    tensors = load_file(dst / last_file)
    if how == "drop":
        del tensors[name], index["weight_map"][name]
        index_path.write_text(json.dumps(index))
    elif how == "ff":
        tensors[name].view(torch.uint8).view(-1)[0] = 255
    elif how == "zero":
        tensors[name] = torch.zeros_like(tensors[name])
    else:
        tensors[name].view(-1)[0] = float(how)
    save_file(tensors, dst / last_file, metadata={"format": "pt"})
    return name


def exported(tmp_path: Path, scheme: str) -> Path:
    """A Quark export of a sharded toy, to use as a source."""
    out = tmp_path / f"export-{scheme}"
    quantize_checkpoint(build_toy("qwen3-moe", tmp_path / f"toy-{scheme}", shard_size="300KB"), out, scheme=scheme,
                        check_engines=[], log=lambda *a: None)
    return out


SOURCES = {  # case -> (toy, source format, fp8 block, tensor suffix, damage, what the line says)
    "native-mxfp4-nan-scale": ("deepseek-v4", None, False, ".scale", "ff", "0xFF"),
    "mxfp8-nan-scale": ("minimax-m3", "mxfp8", False, ".weight_scale_inv", "ff", "0xFF"),
    "ct-mxfp4-no-block-scale": ("kimi-k3", None, False, "w3.weight_scale", "drop", "is missing"),
    "ct-nvfp4-no-block-scale": ("kimi-k3", "ct-nvfp4", False, "w3.weight_scale", "drop", "is missing"),
    "ct-nvfp4-zero-global": ("kimi-k3", "ct-nvfp4", False, ".weight_global_scale", "zero", "zero"),
    "modelopt-nvfp4-zero-global": ("qwen3-moe", "modelopt-nvfp4", False, ".weight_scale_2", "zero", "zero"),
    "modelopt-nvfp4-nan-block": ("qwen3-moe", "modelopt-nvfp4", False, "proj.weight_scale", "ff", "not finite"),
    "block-fp8-nan": ("qwen3-moe", None, True, ".weight_scale_inv", "nan", "not finite"),
    "block-fp8-zero": ("qwen3-moe", None, True, ".weight_scale_inv", "zero", "zero"),
}


@pytest.mark.parametrize("case", sorted(SOURCES))
def test_a_damaged_source_is_refused_before_out_exists(case, tmp_path):
    toy, fmt, fp8_block, suffix, how, says = SOURCES[case]
    clean = build_toy(toy, tmp_path / "clean", source_format=fmt, fp8_block=fp8_block, shard_size="300KB")
    name = damaged(clean, tmp_path / "src", suffix, how)
    out = tmp_path / "out"
    with pytest.raises(QuantError) as caught:
        quantize_checkpoint(tmp_path / "src", out, check_engines=[], log=lambda *a: None)
    line = str(caught.value)
    assert caught.value.exit_code == 2 and name in line and says in line, line
    assert not out.exists(), "refused after OUT was created"
    quantize_checkpoint(clean, tmp_path / "clean-out", check_engines=[], log=lambda *a: None)  # the damage, alone


@pytest.mark.parametrize("scheme,suffix,how,says", [
    ("w_mxfp4_a_mxfp4", "experts.7.down_proj.weight_scale", "ff", "0xFF"),
    ("fp8", "down_proj.weight_scale", "inf", "not finite"),
    ("fp8", "gate_proj.weight_scale", "nan", "not finite"),
    ("fp8", "up_proj.weight_scale", "zero", "zero"),
])
def test_a_damaged_quark_export_used_as_a_source_is_refused_up_front(scheme, suffix, how, says, tmp_path):
    name = damaged(exported(tmp_path, scheme), tmp_path / "src", suffix, how)
    with pytest.raises(QuantError) as caught:
        quantize_checkpoint(tmp_path / "src", tmp_path / "out", check_engines=[], log=lambda *a: None)
    assert caught.value.exit_code == 2 and name in str(caught.value) and says in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_the_scan_reads_scales_only_and_reports_its_cost(tmp_path):
    src = build_toy("deepseek-v4", tmp_path / "src", shard_size="300KB")
    ckpt = open_checkpoint(src)
    stats = require_sound_scales(ckpt, log=lambda *a: None)
    scales = [i for i in ckpt.tensors.values() if i.dtype == "F8_E8M0"]
    assert stats.tensors == len(scales) and 0 < stats.bytes == sum(i.nbytes for i in scales)
    manifest = quantize_checkpoint(src, tmp_path / "out", check_engines=[], log=lambda *a: None)
    assert manifest["timing"]["scale_scan_bytes"] == stats.bytes


def test_a_bad_activation_scale_is_a_note_not_a_refusal(tmp_path):
    """A source's activation scale is consumed with its weight and never written: reported, not refused."""
    src = tmp_path / "src"
    damaged(build_toy("qwen3-moe", tmp_path / "clean", source_format="modelopt-nvfp4", shard_size="300KB"), src,
            ".input_scale", "zero")
    said = []
    quantize_checkpoint(src, tmp_path / "out", check_engines=[], log=said.append)
    assert any(line.startswith("note: scale tensor") and "input_scale" in line for line in said), said
