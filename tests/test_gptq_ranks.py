"""GPTQ on torch.distributed ranks (issue #34): `torchrun --nproc-per-node N -m quant quantize ... --method gptq`
(gloo, CPU) exports the bytes of one process for 2 and 4 ranks, the MTP layer included, each rank running its
share of the calibration batches and solving the weights it owns (the manifest names the rank); a rank killed in
the middle of a layer ends the run with one line (exit 75) and the next launch resumes from the finished layers to
the same bytes. The processes are real (`python -m torch.distributed.run`, `quant quantize --ranks`), each on one
intra-op thread; the toys are tiny and the calibration small (32 windows of 32 tokens: 4 batches)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CALIB = REPO / "evals" / "data" / "toy_arith" / "train.jsonl"
# glm5 (DeepSeek-style, with an MTP layer) under a Hessian budget of two experts a pass: four passes per MoE layer
# in one process, several sweeps per rank; qwen3-moe (plain MoE) under the default budget.
CASES = {"glm5": ["--hessian-budget", "400KiB"], "qwen3-moe": []}

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("gptq-ranks")]  # several processes each: one xdist worker runs them in turn


def _env(kill: str | None = None) -> dict:
    """The ranks' environment; `kill` "RANK:LAYER": that rank kills itself as it starts that decoder layer (the
    tests' fault injection, tests/gptq_faults/sitecustomize.py)."""
    from gptq_faults.sitecustomize import KILL_ENV, kill_env

    env = {**os.environ, "OMP_NUM_THREADS": "1", "QUANT_RANK_TIMEOUT": "120"}
    env.pop(KILL_ENV, None)
    return {**env, **(kill_env(kill) if kill else {})}


def _quantize(src: Path, out: Path, extra: list[str], ranks: int | None = None, launcher: str = "torchrun",
              kill: str | None = None) -> subprocess.CompletedProcess:
    args = ["quantize", str(src), str(out), "--method", "gptq", "--recipe", "all-linear", "--calib-data", str(CALIB),
            "--calib-samples", "32", "--calib-seq-len", "32", "--check-engines", "", "--no-progress", *extra]
    if ranks is None:
        cmd = [sys.executable, "-m", "quant", *args]
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "-m", "quant", *args]
    else:
        cmd = [sys.executable, "-m", "quant", *args, "--ranks", str(ranks)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=_env(kill))


def _ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _export(out: Path) -> dict[str, bytes]:
    names = sorted(p.name for p in out.glob("*.safetensors")) + ["config.json", "model.safetensors.index.json"]
    return {name: (out / name).read_bytes() for name in names}


def _manifest(out: Path) -> dict:
    return json.loads((out / "quant_manifest.json").read_text())


def _solvers(manifest: dict) -> dict[str, int | None]:
    return {name: r["method"].get("rank") for name, r in manifest["tensors"].items()
            if r.get("method", {}).get("method") == "gptq"}


def _without_solvers(manifest: dict) -> dict:
    manifest = json.loads(json.dumps(manifest))
    for record in manifest["tensors"].values():
        for key in ("rank", "worker", "device"):
            record.get("method", {}).pop(key, None)
    return manifest


@pytest.fixture(scope="module")
def one_process(toy_factory, tmp_path_factory):
    """family -> (source, the one-process export)."""
    runs = {}

    def get(family):
        if family not in runs:
            src = toy_factory(family)
            out = tmp_path_factory.mktemp(f"one-{family}") / "out"
            _ok(_quantize(src, out, CASES[family]))
            runs[family] = (src, out)
        return runs[family]

    return get


@pytest.mark.parametrize("family, ranks", [("glm5", 2), ("glm5", 4), ("qwen3-moe", 4)])
def test_ranks_export_the_bytes_of_one_process(family, ranks, one_process, tmp_path):
    src, one = one_process(family)
    out = tmp_path / "ranked"
    result = _ok(_quantize(src, out, CASES[family], ranks))
    assert f"on {ranks} torch.distributed ranks" in result.stderr, result.stderr[-2000:]
    assert f"; {ranks} ranks, rank 0 sent" in result.stderr
    expected, got = _export(one), _export(out)
    assert list(got) == list(expected)
    for name in expected:
        assert got[name] == expected[name], name
    # the manifests differ only in who solved what: every weight solved by some rank, every rank solving some
    solvers = _solvers(_manifest(out))
    assert solvers.keys() == _solvers(_manifest(one)).keys() and solvers
    assert set(solvers.values()) == set(range(ranks)), solvers
    assert set(_solvers(_manifest(one)).values()) == {None}  # one process names no rank
    assert _without_solvers(_manifest(out)) == _without_solvers(_manifest(one))
    if family == "glm5":  # the MTP layer (model.layers.2) is solved on the ranks too
        assert any(name.startswith("model.layers.2.") for name in solvers)
        assert "MTP layer model.layers.2" in result.stderr


def test_a_killed_rank_ends_the_run_in_one_line_and_a_relaunch_resumes(one_process, tmp_path):
    """Rank 2 of 4 kills itself (SIGKILL) as it starts the second decoder layer: one `error:` line, exit 75, the
    first layer kept; the next launch (on 2 ranks) resumes it and exports the bytes of one process."""
    src, one = one_process("glm5")
    out = tmp_path / "out"
    killed = _quantize(src, out, CASES["glm5"], 4, launcher="quant", kill="2:1")
    assert killed.returncode == 75, killed.stderr[-3000:]
    errors = [line for line in killed.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in killed.stderr, killed.stderr[-3000:]
    assert "run the same command again to resume" in errors[0], errors
    assert sorted(p.name for p in (out / ".quant-gptq").glob("*.json")) == ["layer-00000.json"]
    assert not (out / "config.json").exists()

    resumed = _ok(_quantize(src, out, CASES["glm5"], 2))
    assert "gptq: layer 1/2 (resumed)" in resumed.stderr, resumed.stderr[-2000:]
    expected, got = _export(one), _export(out)
    assert list(got) == list(expected) and all(got[n] == expected[n] for n in expected)


def test_rank_0_killed_is_named_by_the_launcher(toy_factory, tmp_path):
    """Rank 0 dies (nobody left to say why): the launcher of --ranks names it in one line, exit 75."""
    killed = _quantize(toy_factory("glm5"), tmp_path / "out", CASES["glm5"], 2, launcher="quant",
                       kill="0:0")
    assert killed.returncode == 75, killed.stderr[-3000:]
    errors = [line for line in killed.stderr.splitlines() if line.startswith("error:")]
    assert errors == [errors[0]] and "GPTQ rank 0 of 2 died (SIGKILL)" in errors[0], killed.stderr[-3000:]
    assert "Traceback" not in killed.stderr


def test_a_rank_killed_under_torchrun_leaves_a_line_from_each_rank_stopped(toy_factory, tmp_path):
    """Under torchrun, rank 1 of 2 killed (SIGKILL): rank 0 is not ended silently by torchrun's SIGTERM; it says
    why in one `error:` line and exits 75, and torchrun (whose own failure report follows) exits 1."""
    killed = _quantize(toy_factory("glm5"), tmp_path / "out", CASES["glm5"], 2, kill="1:1")
    assert killed.returncode == 1, killed.stderr[-3000:]  # torchrun's own exit code after a failed rank
    errors = [line for line in killed.stderr.splitlines() if line.startswith("error:")]
    assert errors and all("run the same command again to resume" in e for e in errors), killed.stderr[-3000:]
    assert "GPTQ rank 0 of 2" in " ".join(errors)
    assert "exitcode  : 75" in killed.stderr and "SIGTERM" not in killed.stderr.split("Failures:")[-1].split(
        "Root Cause")[0], killed.stderr[-3000:]


# -- the parts, in process -----------------------------------------------------------------------------------
def test_shares_cover_the_batches_in_order_and_owners_are_deterministic():
    from quant.gptq.ranks import Ranks

    for size in (1, 2, 3, 4, 8):
        for count in (0, 1, 4, 5, 16):
            shares = [Ranks(r, size).share(count) for r in range(size)]
            assert [b for s in shares for b in s] == list(range(count))
            assert all(Ranks(0, size).holder(b, count) == r for r, s in enumerate(shares) for b in s)
    costs = [5.0, 1.0, 4.0, 3.0, 3.0, 1.0]
    assert Ranks(0, 2).assign(costs) == Ranks(1, 2).assign(costs) == [0, 1, 1, 1, 0, 0]
    assert Ranks(0, 1).assign(costs) == [0] * 6


def test_hessians_fed_from_recorded_inputs_are_the_hooks_bytes(toy_factory, one_torch_thread):
    """What an owner rank computes from the inputs it is sent (`InputRecorder` -> `feed_*`) is, bit for bit, what
    the hooks accumulate while the layer runs (one process): for a plain linear and for each routed expert's
    gate_up and down, also when the owner collects only some experts of one parameter."""
    import torch

    from quant.checkpoint import open_checkpoint
    from quant.families import family_for_config
    from quant.gptq.hessians import HessianCollector, InputRecorder
    from quant.model_exec.layers import DecoderStack

    src = toy_factory("qwen3-moe")
    ckpt = open_checkpoint(src)
    stack = DecoderStack(src, ckpt, family_for_config(ckpt.config).layer_returns, "cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, ckpt.config["vocab_size"], (6, 24), generator=g)
    with torch.no_grad():
        hidden = stack.capture(tokens, 2)
        layer = stack.load_layer(0)
        keys = {k for k, p in layer.named_parameters() if k.endswith(("q_proj.weight", "gate_up_proj", "down_proj"))
                and "shared" not in k}
        fused = sorted(k for k in keys if not k.endswith(".weight"))
        assert fused and len(keys) > len(fused)
        hooks = HessianCollector(layer, keys, None)
        try:
            for _ in stack.run_layer(0, layer, hidden, [{} for _ in hidden]):
                pass
        finally:
            hooks.close()
        recorder = InputRecorder(layer, keys)
        try:
            for x in hidden:
                recorder.next_batch()
                layer(x, **stack.layer_kwargs(0, x.shape[0]))
        finally:
            recorder.close()
        some = {fused[0]: [1, 3, 6], fused[-1]: [0, 6]}
        fed = HessianCollector(layer, keys, some, hooks=False)
        for batch in recorder.batches:
            fed.feed(batch)
    for key in keys:
        if key in some:
            where = fed.expert_slots(key)
            for e in some[key]:
                assert torch.equal(fed.hessians[key][where[e]], hooks.hessians[key][e]), (key, e)
                assert int(fed.tokens[key][where[e]]) == int(hooks.tokens[key][e])
        else:
            assert torch.equal(fed.hessians[key], hooks.hessians[key]), key
            assert torch.equal(fed.tokens[key], hooks.tokens[key]), key
    assert all(int(hooks.tokens[fused[0]][e]) > 0 for e in some[fused[0]])  # routed tokens were compared


def test_sweeps_keep_each_within_the_budget():
    import torch

    from quant.gptq.schedule import Unit, sweeps

    layer = torch.nn.Module()
    layer.register_parameter("e", torch.nn.Parameter(torch.zeros(8, 4, 64)))
    layer.register_parameter("w", torch.nn.Parameter(torch.zeros(4, 64)))
    per = 64 * 64 * 4
    units = [Unit("w", None)] + [Unit("e", (i, i + 1)) for i in range(0, 8, 2)]
    cut = sweeps(units, layer, 3 * per)
    assert [[u.experts for u in s] for s in cut] == [[None, (0, 1)], [(2, 3)], [(4, 5)], [(6, 7)]]
    assert len(sweeps(units, layer, 8 * per)) == 1
    assert sweeps([], layer, per) == [] and sweeps(units[:1], layer, 1) == [units[:1]]


def test_the_dry_run_predicts_each_rank(tmp_path):
    """`--dry-run --ranks 8` on GLM-5.2's config (tests/data/glm52_config): one process needs 11 calibration passes
    per MoE layer at the default 4 GiB budget; on 8 ranks each owns about 32 routed experts (5 GiB of Hessians)
    and collects them in 2 sweeps over its recorded inputs, or in one with --hessian-budget 5GiB, at a lower peak
    per device than the single process's first device."""
    from quant.gptq import GptqSettings
    from quant.gptq.dry_run import predict

    config = str(REPO / "tests" / "data" / "glm52_config")
    single = predict(config, devices="cuda:0", device_memory=80 * 10 ** 9)
    ranked = predict(config, devices="cuda:0", device_memory=80 * 10 ** 9, ranks=8)
    assert single.passes == ranked.passes and single.passes[3] == 11 and not single.rank_sweeps
    assert ranked.rank_sweeps == {**{i: 0 for i in range(3)}, **{i: 2 for i in range(3, 79)}}
    assert ranked.peaks["rank"] < single.peaks["device:cuda:0"]
    assert "one sweep per layer with --hessian-budget 5GiB" in ranked.text()
    wider = predict(config, devices="cuda:0", device_memory=80 * 10 ** 9, ranks=8,
                    settings=GptqSettings(hessian_bytes=5 << 30))
    assert set(wider.rank_sweeps.values()) == {0, 1}
    assert "fits on each rank's device" in wider.text()


def _isas() -> list[str | None]:
    """Each ATEN_CPU_CAPABILITY this CPU can run, and the machine's own (None)."""
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    return [*(isa for isa, flag in (("avx2", " avx2"), ("avx512", " avx512bw")) if flag in flags), "default", None]


@pytest.mark.parametrize("isa", _isas(), ids=lambda isa: isa or "machine-default")
def test_ranks_on_every_core_give_one_process_bytes_under_each_isa(isa, tmp_path):
    """Issue #48: the shipped GPTQ toy, all linears, 64 x 128 calibration tokens, with the thread counts a user gets
    (one process on every core, each rank on its share): 2 ranks differed from one process in 3,989 of 835,584
    codes on an AVX-512 Xeon (MKL split the Hessian's X^T X over the tokens by thread count). 1, 2 and 4 ranks now
    give the same bytes and the same manifest, apart from who solved what."""
    toy = REPO / "tests" / "data" / "gptq_toy"
    env = {k: v for k, v in _env().items() if k not in ("OMP_NUM_THREADS", "ATEN_CPU_CAPABILITY")}
    env.update({"ATEN_CPU_CAPABILITY": isa} if isa else {})
    outs = {}
    for ranks in (None, 2, 4):
        outs[ranks] = tmp_path / f"ranks-{ranks or 1}"
        args = ["quantize", str(toy / "model"), str(outs[ranks]), "--method", "gptq", "--recipe", "all-linear",
                "--calib-data", str(toy / "calib.jsonl"), "--calib-samples", "64", "--calib-seq-len", "128",
                "--check-engines", "", "--no-progress", *(["--ranks", str(ranks)] if ranks else [])]
        _ok(subprocess.run([sys.executable, "-m", "quant", *args], capture_output=True, text=True, timeout=600,
                           cwd=REPO, env=env))
    one = _export(outs[None])
    for ranks in (2, 4):
        got = _export(outs[ranks])
        assert list(got) == list(one)
        for name in one:
            assert got[name] == one[name], (ranks, name)
        assert _without_solvers(_manifest(outs[ranks])) == _without_solvers(_manifest(outs[None])), ranks


def test_the_rank_killed_is_the_one_named_not_the_one_the_launcher_stopped():
    """Issue #49: rank 1 of 2 killed under `--ranks`: the line blamed "rank 0 of 2 died (SIGTERM)", the launcher's
    own SIGTERM to the survivor, whose timestamp (whole seconds) tied with the killed rank's."""
    import signal
    from types import SimpleNamespace

    from quant.gptq.ranks import lost_rank

    def failure(sig, ts):
        return SimpleNamespace(exitcode=-sig, timestamp=ts)

    same_second = {0: failure(signal.SIGTERM, 100), 1: failure(signal.SIGKILL, 100)}
    assert lost_rank(same_second)[0] == 1
    assert lost_rank({0: failure(signal.SIGTERM, 99), 1: failure(signal.SIGKILL, 100)})[0] == 1
    assert lost_rank({0: failure(signal.SIGKILL, 100), 1: failure(signal.SIGTERM, 100)})[0] == 0
    assert lost_rank({0: failure(signal.SIGTERM, 101), 1: failure(signal.SIGTERM, 100)})[0] == 1  # then the clock
