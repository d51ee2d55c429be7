"""GPTQ for MXFP4 (`quant quantize --method gptq`): the solver's contract, and whole exports of every toy family.

The solver: with a diagonal Hessian (no correlation between inputs) there is nothing to compensate and GPTQ must be
bit-identical to round-to-nearest in every scale mode; with correlated inputs it must lower the output error it
minimises; and what it returns must be ordinary MXFP4 (the packed codes and scales decode to its values).

The exports: transformers runs the calibration text through each toy family's real decoder layers, and the
export must have exactly the tensors (names, dtypes, shapes) of the round-to-nearest export, pass the engines'
preflight, and, on the trained arithmetic toy, predict held-out text better than round-to-nearest.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from quant.errors import QuantError
from quant.gptq import CalibrationSettings, GptqSettings, gptq_mxfp4, output_error
from quant.numerics import SCALE_MODES, mxfp4
from quant.pipeline import quantize_checkpoint

REPO = Path(__file__).resolve().parent.parent
TOY_ARITH = REPO / "evals" / "data" / "toy_arith"
CALIB = TOY_ARITH / "train.jsonl"
GPTQ_TOY = Path(__file__).parent / "data" / "gptq_toy"


def _correlated_inputs(k: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) * 0.3 + torch.eye(k)
    x = torch.randn(n, k, generator=g) @ mix
    x[:, :4] *= 8  # a few outlier channels, as in real activations
    return x


@pytest.mark.parametrize("mode", SCALE_MODES)
def test_diagonal_hessian_rounds_to_nearest(mode):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3, 16, 128, generator=g) * torch.logspace(-3, 1, 128)
    h = torch.diag_embed(torch.rand(3, 128, generator=g) + 0.1)
    solved = gptq_mxfp4(w, h, mode)
    packed, scales = mxfp4.quantize_mxfp4(w, mode=mode)
    assert torch.equal(solved.scales, scales)
    assert torch.equal(solved.packed, packed)


@pytest.mark.parametrize("mode", ["even", "rceil"])
def test_correlated_inputs_lower_the_output_error(mode):
    x = _correlated_inputs(256, 2048)
    h = (x.t() @ x).unsqueeze(0)
    w = torch.randn(1, 64, 256, generator=torch.Generator().manual_seed(2))
    solved = gptq_mxfp4(w, h, mode)
    rtn = mxfp4.dequantize_mxfp4(*mxfp4.quantize_mxfp4(w, mode=mode), dtype=torch.float32)
    err_gptq, err_rtn = float(output_error(w, solved.values, h)), float(output_error(w, rtn, h))
    assert err_gptq < 0.6 * err_rtn, (err_gptq, err_rtn)
    # Ordinary MXFP4: the stored codes and scales decode to exactly the values GPTQ computed with.
    assert torch.equal(mxfp4.dequantize_mxfp4(solved.packed, solved.scales, dtype=torch.float32), solved.values)


def test_dead_input_columns_are_rounded_to_nearest():
    x = _correlated_inputs(64, 512)
    x[:, 32:] = 0  # a whole block of inputs no calibration token reached
    w = torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(3))
    solved = gptq_mxfp4(w, (x.t() @ x).unsqueeze(0))
    packed, scales = mxfp4.quantize_mxfp4(w[..., 32:].contiguous())
    assert torch.equal(solved.packed[..., 16:], packed) and torch.equal(solved.scales[..., 1:], scales)


def _tensors(out: Path) -> dict[str, tuple[str, tuple]]:
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    result = {}
    for file in sorted(set(index.values())):
        with safe_open(str(out / file), framework="pt") as f:
            for name in f.keys():
                s = f.get_slice(name)
                result[name] = (s.get_dtype(), tuple(s.get_shape()))
    return result


FAST = GptqSettings(CalibrationSettings(str(CALIB), samples=8, seq_len=64), batch=4)


# minimax-m2/m3: checkpoint names transformers maps only when loading a whole model (family transformers_layer);
# kimi-k2.5/minimax-m3: vision-language wrappers whose text model is built alone
@pytest.mark.parametrize("family", ["glm5", "deepseek-v3", "qwen3-moe", "qwen3.5", "minimax-m2", "kimi-k2.5",
                                    "minimax-m3"])
def test_gptq_export_matches_the_rtn_export(family, toy_factory, tmp_path, one_torch_thread):
    src = toy_factory(family)
    rtn = quantize_checkpoint(src, tmp_path / "rtn", recipe="all-linear", log=lambda m: None)
    logs = []
    gptq = quantize_checkpoint(src, tmp_path / "gptq", recipe="all-linear", method="gptq", gptq=FAST,
                               log=logs.append)  # the self-check (SGLang and vLLM rules) runs inside
    assert _tensors(tmp_path / "gptq") == _tensors(tmp_path / "rtn")
    assert json.loads((tmp_path / "gptq" / "config.json").read_text())["quantization_config"] == \
        json.loads((tmp_path / "rtn" / "config.json").read_text())["quantization_config"]
    assert gptq["settings"]["method"] == "gptq" and gptq["settings"]["calibration"]["samples"] == 8
    assert "method" not in rtn["settings"]
    quantized = {n: r["method"] for n, r in gptq["tensors"].items() if r["action"] == "quantize"}
    for name, method in quantized.items():  # every module says how it was rounded, and why not GPTQ
        assert method["method"] == "gptq" or method["why"], (name, method)
        if ".experts." not in name and not method.get("why", "").startswith("MTP"):
            assert method["method"] == "gptq", (name, method)  # dense linears see every calibration token
    assert sum(m["method"] == "gptq" for m in quantized.values()) >= 10
    # Not a copy of the RTN export: the solved weights differ, and reduce the error on the calibration inputs.
    solved = [r["method"] for r in gptq["tensors"].values() if r.get("method", {}).get("method") == "gptq"]
    assert sum(r["calib_rel_error_gptq"] for r in solved) < sum(r["calib_rel_error_rtn"] for r in solved)
    assert not (tmp_path / "gptq" / ".quant-gptq").exists()
    assert any(m.startswith("gptq: layer") for m in logs)


def gptq_toy_heldout(windows: int = 128, length: int = 128) -> list[str]:
    """The held-out texts of tests/data/gptq_toy: its GSM8K test problems joined, cut into `windows` windows of
    `length` byte tokens (scripts/bench_gptq_peers.py scores its peers on the same)."""
    rows = [json.loads(line) for line in (GPTQ_TOY / "heldout.jsonl").read_text().splitlines()]
    joined = "\n\n".join(f"{r['question']}\n{r['answer']}" for r in rows)
    return [joined[i:i + length] for i in range(0, len(joined) - length + 1, length)][:windows]


def gptq_toy_calibration(seed: int = 0) -> CalibrationSettings:
    """The toy's calibration: 64 windows of 128 tokens of its calib.jsonl, cut at offsets drawn with `seed`."""
    return CalibrationSettings(str(GPTQ_TOY / "calib.jsonl"), samples=64, seq_len=128, seed=seed)


def test_gptq_recovers_most_of_rtns_held_out_loss(tmp_path, one_torch_thread):
    """The quantization-sensitive toy (tests/data/gptq_toy: trained without fake-quant, on GSM8K text beside its
    task): every linear in MXFP4, held-out NLL on GSM8K test text. RTN loses, GPTQ must beat it and recover at
    least half of the loss (scripts/bench_gptq.py measures the same at full size)."""
    from evals.arms.nll import mean_nll

    texts = gptq_toy_heldout()
    settings = GptqSettings(gptq_toy_calibration())
    for method in ("rtn", "gptq"):
        quantize_checkpoint(GPTQ_TOY / "model", tmp_path / method, recipe="all-linear", method=method,
                            gptq=settings, check_engines=None, log=lambda m: None)
    nll = {m: mean_nll(tmp_path / m, texts) for m in ("rtn", "gptq")}
    nll["bf16"] = mean_nll(GPTQ_TOY / "model", texts)
    assert nll["rtn"] > nll["bf16"] + 0.003, nll  # the toy is sensitive: RTN measurably loses
    assert nll["gptq"] < nll["rtn"], nll
    assert (nll["rtn"] - nll["gptq"]) / (nll["rtn"] - nll["bf16"]) >= 0.5, nll


def _interrupted_at_layer_1(monkeypatch):
    """Stop the next runs (Ctrl-C) as they start decoder layer 1, where the layer loop (quant.gptq.loop) begins it;
    returns what lets them run again."""
    import quant.gptq.loop as loop

    run = loop.LayerLoop.run

    def interrupted(self, index: int, *args, **kwargs):
        if index == 1:
            raise KeyboardInterrupt
        return run(self, index, *args, **kwargs)

    monkeypatch.setattr(loop.LayerLoop, "run", interrupted)
    return lambda: monkeypatch.setattr(loop.LayerLoop, "run", run)


def test_gptq_resumes_from_the_solved_layers(toy_factory, tmp_path, monkeypatch, one_torch_thread):
    """A run killed in layer 1 resumes with layer 0's solution (not solved again) and ends byte-identical to an
    uninterrupted run."""
    import quant.gptq.loop as loop

    src = toy_factory("qwen3-moe")
    clean = quantize_checkpoint(src, tmp_path / "clean", recipe="all-linear", method="gptq", gptq=FAST,
                                check_engines=None, log=lambda m: None)
    resume = _interrupted_at_layer_1(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(src, tmp_path / "out", recipe="all-linear", method="gptq", gptq=FAST,
                            check_engines=None, log=lambda m: None)
    assert (tmp_path / "out" / ".quant-gptq" / "layer-00000.json").is_file()
    assert not (tmp_path / "out" / "config.json").exists()
    resume()
    logs = []
    resumed = quantize_checkpoint(src, tmp_path / "out", recipe="all-linear", method="gptq", gptq=FAST,
                                  check_engines=None, log=logs.append)
    assert any("layer 1/" in m and "(resumed)" in m for m in logs), logs
    assert not any("layer 2/" in m and "(resumed)" in m for m in logs), logs
    assert resumed["output"]["shards"] == clean["output"]["shards"]


@pytest.mark.parametrize("setup, message", [
    (lambda tmp: tmp / "missing.jsonl", "calibration file not found"),
    (lambda tmp: (tmp / "bad.jsonl").write_text("{not json\n") and tmp / "bad.jsonl", "bad.jsonl:1: not JSON"),
    (lambda tmp: (tmp / "tiny.txt").write_text("1 + 1") and tmp / "tiny.txt", "fewer than --calib-seq-len"),
    (lambda tmp: (tmp / "data.csv").write_text("a,b") and tmp / "data.csv", "must be .txt, .jsonl"),
])
def test_bad_calibration_data_is_one_clear_error(setup, message, toy_factory, tmp_path):
    path = setup(tmp_path)
    with pytest.raises(QuantError, match=message.replace("+", r"\+")):
        quantize_checkpoint(toy_factory("qwen3-moe"), tmp_path / "out", method="gptq",
                            gptq=GptqSettings(CalibrationSettings(str(path), samples=2, seq_len=64)),
                            check_engines=None, log=lambda m: None)
    assert not (tmp_path / "out" / "config.json").exists()


def test_gptq_needs_an_mxfp4_scheme(toy_factory, tmp_path):
    with pytest.raises(QuantError, match="--method gptq solves MXFP4 weights"):
        quantize_checkpoint(toy_factory("qwen3-moe"), tmp_path / "out", scheme="fp8", method="gptq")


@pytest.mark.parametrize("build, flag", [
    (lambda: GptqSettings(damp=0.0), "--damp 0: must be a positive finite number"),
    (lambda: GptqSettings(damp=-1.0), "--damp -1: must be a positive finite number"),
    (lambda: GptqSettings(damp=float("nan")), "--damp nan: must be a positive finite number"),
    (lambda: GptqSettings(damp=float("inf")), "--damp inf: must be a positive finite number"),
    (lambda: CalibrationSettings(str(CALIB), samples=0), "--calib-samples 0: must be"),
    (lambda: CalibrationSettings(str(CALIB), seq_len=1), "--calib-seq-len 1: must be"),
])
def test_bad_gptq_settings_are_one_line_naming_the_flag(build, flag):
    with pytest.raises(QuantError, match=flag):
        build()


@pytest.mark.parametrize("damp", ["0", "-1", "nan"])
def test_bad_damp_on_the_command_line_is_a_user_error(damp, tmp_path):
    from typer.testing import CliRunner

    from quant.cli import app

    result = CliRunner().invoke(app, ["quantize", str(tmp_path / "src"), str(tmp_path / "out"), "--method", "gptq",
                                      "--damp", damp])
    assert isinstance(result.exception, QuantError), result.exception
    assert str(result.exception).startswith(f"--damp {damp}: must be a positive finite number")


def test_gptq_reports_progress_before_and_within_layers(toy_factory, tmp_path, monkeypatch, one_torch_thread):
    """A line before calibration (windows, tokens), one when the first layer starts, and lines within a layer
    (weights and experts solved, ETAs for the layer and the run); throttled to one per PROGRESS_SECONDS."""
    import quant.gptq.progress as progress

    monkeypatch.setattr(progress, "PROGRESS_SECONDS", 0.0)
    logs = []
    settings = GptqSettings(CalibrationSettings(str(CALIB), samples=4, seq_len=32), batch=4, solve_bytes=1 << 16)
    quantize_checkpoint(toy_factory("qwen3-moe"), tmp_path / "out", method="gptq", gptq=settings,
                        check_engines=None, log=logs.append)
    gptq = [m for m in logs if m.startswith("gptq:")]
    assert gptq[0].startswith("gptq: calibration: 4 windows x 32 tokens (128 tokens)"), gptq
    assert gptq[1].startswith("gptq: layer 1/2: starting"), gptq
    within = [m for m in gptq if "weights done (experts" in m]
    assert within and all("layer ETA" in m and "run ETA" in m for m in within), gptq
    first = gptq.index(next(m for m in gptq if m.startswith("gptq: layer 1/2 ")))
    assert any("weights done (experts" in m for m in gptq[2:first]), gptq  # within the first layer
    assert "run ETA" in gptq[first]  # the finished first layer's line: the rest of the run


def test_gptq_resume_reuses_no_layer_solved_from_other_bytes(toy_factory, tmp_path, monkeypatch, one_torch_thread):
    """Bytes, not names: a GPTQ run killed in layer 1, its source's layer-0 weights edited in place (header and
    modification time kept), resumed: layer 0 is solved again from the new bytes (every later layer's inputs change
    with it) and the export equals an uninterrupted run on the edited source."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    import quant.gptq.loop as loop

    src = tmp_path / "src"
    shutil.copytree(toy_factory("qwen3-moe"), src)
    resume = _interrupted_at_layer_1(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(src, tmp_path / "out", recipe="all-linear", method="gptq", gptq=FAST,
                            check_engines=None, log=lambda m: None)
    resume()
    shard = next(p for p in sorted(src.glob("*.safetensors"))
                 if any(".layers.0.mlp.experts.0." in n for n in load_file(p)))
    st = shard.stat()
    tensors = load_file(shard)
    name = next(n for n in sorted(tensors) if ".layers.0.mlp.experts.0.down_proj.weight" in n)
    tensors[name] = (tensors[name].float() * -3.0).to(tensors[name].dtype)
    save_file(tensors, shard, metadata={"format": "pt"})
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    logs = []
    resumed = quantize_checkpoint(src, tmp_path / "out", recipe="all-linear", method="gptq", gptq=FAST,
                                  check_engines=None, log=logs.append)
    assert not any("(resumed)" in m for m in logs), logs
    fresh = quantize_checkpoint(src, tmp_path / "fresh", recipe="all-linear", method="gptq", gptq=FAST,
                                check_engines=None, log=lambda m: None)
    assert resumed["output"]["shards"] == fresh["output"]["shards"]
