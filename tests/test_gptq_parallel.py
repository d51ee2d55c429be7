"""GPTQ on several workers (`--devices cpu,cpu`, `--workers 2`): each layer's solves are shared among the workers,
and the export is byte-identical to one worker's (the MTP layer's solves included); the manifest says which worker
(and device) solved each weight. (A family whose decoder layers GPTQ cannot build is refused with one line before any
calibration work: tests/test_families_e2e.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quant.gptq import CalibrationSettings, GptqSettings
from quant.pipeline import quantize_checkpoint

REPO = Path(__file__).resolve().parent.parent
CALIB = REPO / "evals" / "data" / "toy_arith" / "train.jsonl"
FAST = GptqSettings(CalibrationSettings(str(CALIB), samples=8, seq_len=64), batch=4)  # as tests/test_gptq.py


def _solved_by(manifest: dict) -> dict[str, tuple[int, str]]:
    return {name: (r["method"]["worker"], r["method"]["device"]) for name, r in manifest["tensors"].items()
            if r.get("method", {}).get("method") == "gptq"}


def _without_workers(manifest: dict) -> dict:
    manifest = json.loads(json.dumps(manifest))
    for record in manifest["tensors"].values():
        for key in ("worker", "device"):
            record.get("method", {}).pop(key, None)
    manifest["run"].pop("devices", None)
    manifest.pop("timing", None)
    return manifest


@pytest.mark.parametrize("family, devices", [("qwen3-moe", "cpu,cpu"), ("glm5", None)])
def test_two_workers_give_the_bytes_of_one(family, devices, toy_factory, tmp_path, one_torch_thread):
    src = toy_factory(family)
    one = quantize_checkpoint(src, tmp_path / "one", recipe="all-linear", method="gptq", gptq=FAST, devices="cpu",
                              check_engines=None, log=lambda m: None)
    logs = []
    # devices=None: `--devices auto` with --workers 2 (this machine has no GPU)
    two = quantize_checkpoint(src, tmp_path / "two", recipe="all-linear", method="gptq", gptq=FAST,
                              devices=devices, workers=2, check_engines=None, log=logs.append)
    files = sorted(p.name for p in (tmp_path / "one").glob("*.safetensors"))
    assert files and files == sorted(p.name for p in (tmp_path / "two").glob("*.safetensors"))
    for name in files + ["config.json"]:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    assert set(_solved_by(one).values()) == {(0, "cpu")}
    assert set(_solved_by(two).values()) == {(0, "cpu"), (1, "cpu")}
    assert _solved_by(one).keys() == _solved_by(two).keys()
    if family == "glm5":  # the MTP layer (model.layers.2) is solved too, on both workers' share
        assert any(name.startswith("model.layers.2.") for name in _solved_by(two)), _solved_by(two)
    assert _without_workers(one) == _without_workers(two)  # the manifests differ only in who solved what
    assert two["run"]["devices"] == ["cpu", "cpu"]
    assert any("solved on 2 workers (cpu,cpu)" in m for m in logs), logs


def test_worker_assignment_is_deterministic_and_balanced():
    from quant.gptq.schedule import Workers

    costs = [5.0, 1.0, 4.0, 3.0, 3.0, 1.0]
    owner = Workers(["cpu", "cpu"]).assign(costs)
    assert owner == Workers(["cpu", "cpu"]).assign(costs) == [0, 1, 1, 1, 0, 0]
    assert Workers(["cpu"]).assign(costs) == [0] * len(costs)


def test_a_failing_worker_stops_the_others_and_is_raised():
    from quant.gptq.schedule import Workers

    ran = []

    def ok(i):
        return lambda device: ran.append(i) or i

    def boom(device):
        raise RuntimeError("solver failed")

    with Workers(["cpu", "cpu"]) as workers:
        assert workers.run([ok(0), ok(1), ok(2)], [1.0, 1.0, 1.0]) == [(0, 0), (1, 1), (0, 2)]
        with pytest.raises(RuntimeError, match="solver failed"):
            workers.run([boom, ok(3), ok(4)], [3.0, 1.0, 1.0])


def _mtp_outputs(manifest: dict, block: str = "model.layers.2.") -> dict[str, dict]:
    return {name: r for name, r in manifest["tensors"].items() if name.startswith(block) and r["action"] == "quantize"}


def test_the_mtp_layer_is_solved_after_the_main_layers(toy_factory, tmp_path, one_torch_thread):
    """The GLM-5 toy's MTP layer (model.layers.2, beyond num_hidden_layers: transformers never runs it) is fed the
    final-norm hidden states and next-token embeddings, as the engines run the draft, and its MXFP4 weights are
    GPTQ-solved like a main layer's: records naming the solver's worker and device, weights that differ from
    round-to-nearest, lower error on the calibration inputs. A recipe that keeps the MTP layer BF16 solves
    nothing there."""
    src = toy_factory("glm5")
    logs = []
    gptq = quantize_checkpoint(src, tmp_path / "gptq", recipe="all-linear", method="gptq", gptq=FAST,
                               devices="cpu", check_engines=None, log=logs.append)
    quantize_checkpoint(src, tmp_path / "rtn", recipe="all-linear", check_engines=None, log=lambda m: None)
    mtp = _mtp_outputs(gptq)
    assert mtp and {r["method"]["method"] for r in mtp.values()} <= {"gptq", "rtn"}
    dense = {n: r for n, r in mtp.items() if ".experts." not in n}
    assert dense and all(r["method"]["method"] == "gptq" for r in dense.values()), dense
    solved = {n: r["method"] for n, r in mtp.items() if r["method"]["method"] == "gptq"}
    assert all(m["worker"] == 0 and m["device"] == "cpu" and m["tokens"] > 0 for m in solved.values())
    assert all(m["why"] for n, r in mtp.items() if (m := r["method"])["method"] == "rtn")  # too few tokens
    assert sum(m["calib_rel_error_gptq"] for m in solved.values()) < sum(m["calib_rel_error_rtn"]
                                                                          for m in solved.values())
    # the solved codes are not round-to-nearest's
    index = json.loads((tmp_path / "gptq" / "model.safetensors.index.json").read_text())["weight_map"]
    from safetensors import safe_open

    differ = 0
    for name in solved:
        key = f"{name}.weight"
        with safe_open(str(tmp_path / "gptq" / index[key]), framework="pt") as a, \
                safe_open(str(tmp_path / "rtn" / index[key]), framework="pt") as b:
            differ += not bool((a.get_tensor(key) == b.get_tensor(key)).all())
    assert differ == len(solved), (differ, len(solved))
    assert any(m.startswith("gptq: MTP layer model.layers.2 ") for m in logs), logs

    logs = []
    kept = quantize_checkpoint(src, tmp_path / "kept", recipe="experts-only-mtp-bf16", method="gptq", gptq=FAST,
                               devices="cpu", check_engines=None, log=logs.append)
    assert not _mtp_outputs(kept) and not any("MTP layer" in m for m in logs), logs


def test_the_mtp_block_computes_what_the_eval_draft_computes(toy_factory):
    """`quant.model_exec.mtp.MtpBlock` (what GPTQ calibrates the MTP layer with) and `evals.arms.mtp_draft` (what the
    acceptance measurement runs, as the engines do) give the same draft hidden states for the same inputs."""
    import torch

    from evals.arms.mtp_draft import load_draft
    from quant.checkpoint import open_checkpoint
    from quant.gptq.mtp import mtp_layers
    from quant.model_exec.layers import DecoderStack
    from quant.model_exec.mtp import MtpBlock

    src = toy_factory("glm5")
    ckpt = open_checkpoint(src)
    stack = DecoderStack(src, ckpt, ["hidden_states", "prev_topk_indices"], "cpu", torch.float32)
    (ref,) = mtp_layers(ckpt)
    block = MtpBlock(stack, ref.names)
    draft = load_draft(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, ckpt.config["vocab_size"], (2, 24), generator=g)
    hidden = torch.randn(2, 24, ckpt.config["hidden_size"], generator=g)
    with torch.no_grad():
        z, positions = block.inputs(tokens, hidden)
        ours = block.run(z, positions)
        theirs, _ = draft(0, tokens, hidden, positions)
    torch.testing.assert_close(ours, theirs)
