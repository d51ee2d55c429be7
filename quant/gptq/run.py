"""GPTQ over a whole checkpoint, one decoder layer at a time (`quant quantize --method gptq`).

Data flow: the calibration windows run through transformers' own model (built from config.json on the meta
device: `quant.model_exec.layers.DecoderStack`) up to the first decoder layer; then, for each decoder layer in
turn, only that layer's weights are read from the source shards, the input Hessians of its MXFP4 weights are
accumulated over the calibration activations, each weight is solved (`solve.gptq_mxfp4`), every quantized weight
of the layer is replaced by what the engines will compute with, and the activations go through the quantized layer
to become the next layer's inputs. Peak memory is one layer, its Hessians and two copies of the calibration
activations.

The solved weights (packed codes and scale bytes, exactly what the export stores) go to the store the pipeline
gives (`OUT/.quant-gptq/`), one safetensors file per layer with a JSON record beside it; the shard writer
(`pipeline.execute`) takes them from there (`SolvedWeights`) instead of rounding to nearest. The pipeline knows
GPTQ only as the `quant.pipeline.solver.WeightSolver` the command hands it (`GptqSettings`). A killed run resumes
at the first layer without a record (earlier layers are re-run forward with their solved weights, not re-solved).

The MTP / NextN draft layers (beyond num_hidden_layers; transformers never runs them) are solved after the main
layers, with the same solver and settings: each is built and fed as the engines run it (`quant.gptq.mtp`,
`quant.model_exec.mtp`: the
final-norm hidden state of the quantized main layers at t and the embedding of token t+1, through the draft's
BF16 glue), and its records and solved weights go to `mtp-NNNNN.*` beside the layers'. A recipe that keeps the
MTP layers BF16 leaves nothing to solve there.

On several torch.distributed ranks (`quant.gptq.ranks`: torchrun, or `quant quantize --ranks N`), each rank runs
its share of the calibration batches through every layer and solves the weights it owns, fed their inputs batch by
batch in the global order (`_solve_layer_ranked`); the bytes are one process's.

What stays round-to-nearest, and why (each recorded in the manifest as `method`):
  - FP8-scheme modules of mixed recipes (GPTQ here is the MXFP4 grid's);
  - routed experts that fewer than `MIN_EXPERT_TOKENS` calibration tokens were routed to: their Hessian is too
    poorly estimated to steer the rounding (the damping would dominate it); with zero tokens there is nothing to
    steer by at all;
  - weights that are neither an nn.Linear nor a fused expert parameter of transformers' layer.
Experts with at least MIN_EXPERT_TOKENS but fewer tokens than input columns get damping scaled up by
columns / tokens, so their rank-deficient Hessian is regularised in proportion.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from quant.errors import QuantError
from quant.gptq.calibration import CalibrationSettings, calibration_tokens, data_identity
from quant.planning.plan import LAYER, Plan, TensorJob
from quant.planning.schemes import MXFP4_SCHEMES

MIN_EXPERT_TOKENS = 64
_EXPERT = re.compile(r"^(.*\bexperts\.\d+)\.")
PROGRESS_SECONDS = 10.0  # at most one progress line this often within a layer
# The phases of a GPTQ run, as `SolvedWeights.timing` (and the manifest's `timing`) name their seconds: tokenizing
# the calibration text and running it to the first decoder layer; reading each layer's weights; the forward passes
# that accumulate the input Hessians; the solves (all workers, wall time); saving each layer's solution;
# replacing the layer's weights by their quantized values (apply: the whole layer, on every rank); and running the
# calibration activations through it to the next layer (the MTP layers' inputs included).
# On several ranks (`quant.gptq.ranks`), the seconds a rank waited in its collectives are `gptq_comm_s`, not counted
# in the phase they happened in.
PHASES = ("gptq_calibration_s", "gptq_load_s", "gptq_hessians_s", "gptq_solve_s", "gptq_save_s", "gptq_apply_s",
          "gptq_forward_s", "gptq_comm_s")
# For benchmarks (scripts/bench_gptq_ranks.py): a path prefix; each rank (one process: rank 0) writes PREFIX.RANK, a
# JSON record of its seconds per phase, the CPU seconds of the forward, Hessian and solve phases, and the bytes its
# collectives moved.
TIMING_ENV = "QUANT_GPTQ_TIMING"


@dataclass(frozen=True)
class GptqSettings:
    """GPTQ's settings, and the solver the quantize command hands the pipeline (a
    `quant.pipeline.solver.WeightSolver`: `check`, `to_dict`, `solve`)."""

    method: ClassVar[str] = "gptq"
    calibration: CalibrationSettings = field(default_factory=CalibrationSettings)
    damp: float = 0.01  # relative to the mean diagonal of H, as in GPTQ's reference code
    batch: int = 8  # calibration windows per forward call
    hessian_bytes: int = 4 << 30  # budget for one pass's expert Hessians; more experts take more passes
    solve_bytes: int = 1 << 29  # budget for the solver's working set; more experts are solved in more groups
    # This process's place among torch.distributed ranks (`quant.gptq.ranks.Ranks`), None for one process: never
    # part of the settings' identity (the same export on any number of ranks).
    ranks: object = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        """--damp must be a positive finite number: 0 leaves a singular Hessian singular, a negative one makes it
        indefinite, NaN poisons every solve (each used to stop deep inside the first layer)."""
        damp = self.damp
        if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not math.isfinite(damp) or damp <= 0:
            shown = f"{damp:g}" if isinstance(damp, (int, float)) else repr(damp)
            raise QuantError(f"--damp {shown}: must be a positive finite number (default 0.01)")
        if self.batch < 1:
            raise QuantError(f"GPTQ batch {self.batch}: must be at least 1")

    def to_dict(self, with_identity: bool = True) -> dict:
        d = {"method": "gptq", "damp": self.damp, "min_expert_tokens": MIN_EXPERT_TOKENS,
             "calibration": self.calibration.to_dict()}
        if with_identity:
            d["calibration"]["identity"] = data_identity(self.calibration.data)
        return d

    def check(self, src_path: Path, ckpt) -> None:
        """The calibration data, and the family: one transformers cannot build GPTQ's decoder layers of is refused
        (QuantError) before any work."""
        from quant.model_exec.layers import meta_model

        self.calibration.check()
        meta_model(src_path, ckpt)
        if self.ranks is not None and self.ranks.size > 1:
            from quant.gptq.ranks import lead_prepare

            lead_prepare(self.ranks, src_path)

    def solve(self, request) -> "SolvedWeights":
        """`solve_checkpoint` for the pipeline's `quant.pipeline.solver.SolveRequest` (rank 0 of several: the other
        ranks are handed the run first, `ranks.lead_solve`)."""
        ranks, devices = self.ranks, request.devices
        if ranks is not None and ranks.size > 1:
            from quant.gptq.ranks import lead_solve

            lead_solve(ranks, request, self)
            devices = [ranks.device]
        return solve_checkpoint(request.plan, request.ckpt, request.src_path, request.store, devices, self,
                                request.layer_returns, request.digest, request.write, request.log, ranks=ranks)


def layer_of(job: TensorJob) -> int | None:
    m = LAYER.search(job.source.name)
    return int(m.group(1)) if m else None


def quantized_jobs_by_layer(plan: Plan) -> dict[int, list[TensorJob]]:
    by_layer: dict[int, list[TensorJob]] = defaultdict(list)
    for shard in plan.shards:
        for job in shard.jobs:
            if job.action == "quantize" and layer_of(job) is not None:
                by_layer[layer_of(job)].append(job)
    return by_layer


class SolvedWeights:
    """The solved weights in the run's store (OUT/.quant-gptq/), a `quant.pipeline.solver.Solution`: `parts(job)`
    gives {suffix: tensor} and the record of a weight GPTQ solved, or None (round it to nearest). `timing`: seconds
    per phase of the run that solved them (`PHASES`)."""

    def __init__(self, root: Path, decoder_layers: int, timing: dict[str, float] | None = None):
        self.root, self.decoder_layers = root, decoder_layers
        self.timing = dict(timing or {})
        self.records: dict[str, dict] = {}
        self.files: dict[str, Path] = {}
        paths = sorted(root.glob("layer-*.json")) + sorted(root.glob("mtp-*.json")) if root.is_dir() else []
        for rec_path in paths:
            data = json.loads(rec_path.read_text())
            for output, record in data["weights"].items():
                self.records[output] = record
                self.files[output] = rec_path.with_suffix(".safetensors")

    def parts(self, job: TensorJob):
        record = self.records.get(job.output)
        if record is None:
            layer = layer_of(job)
            why = ("outside the decoder layers" if layer is None else
                   "MTP/NextN layer: no in-process MTP draft to run it on calibration data (family data mtp_draft: "
                   "none, or a block transformers cannot build)"
                   if layer >= self.decoder_layers else "no record of this layer")
            return None, {"method": "rtn", "why": why}
        if record["method"] != "gptq":
            return None, record
        from safetensors import safe_open

        with safe_open(str(self.files[job.output]), framework="pt") as f:
            return {s: f.get_tensor(f"{job.output}.{s}") for s in ("weight", "weight_scale")}, record


def _layer_file(store: Path, index: int | str, suffix: str) -> Path:
    """A main layer's file (`index` its number) or an MTP layer's (`index` "mtp-K")."""
    return store / (f"{index}{suffix}" if isinstance(index, str) else f"layer-{index:05d}{suffix}")


def _layer_digest(plan_digest: str, index: int | str) -> str:
    return hashlib.sha256(f"{plan_digest}:{index}".encode()).hexdigest()


def _chained(key: str, read: str) -> str:
    """The content key of the next layer's solution: the key of everything before it (settings, calibration
    tokens, the text model's own weights and every earlier layer) and the sha256 of the bytes its load read. A
    layer's inputs are made by every layer before it, so an edit anywhere upstream makes every later solution
    stale."""
    return hashlib.sha256(f"{key}:{read}".encode()).hexdigest()


def _run_key(digest: str, tokens, stack) -> str:
    """The start of the chain: the plan digest, the calibration tokens' bytes and what the text model's own
    weights (embedding, final norm) read."""
    h = hashlib.sha256(f"{digest}:{stack.identity['text']}:{list(tokens.shape)}:".encode())
    h.update(tokens.contiguous().view(-1).cpu().numpy().tobytes())
    return h.hexdigest()


def solve_checkpoint(plan: Plan, ckpt, src_path: Path, store: Path | None, devices: str | list[str],
                     settings: GptqSettings, layer_returns: list[str], digest: str, write, log=print,
                     ranks=None) -> SolvedWeights | None:
    """Solve every MXFP4 weight of the decoder layers with GPTQ into `store` (OUT/.quant-gptq/; resuming what an
    earlier run of the same plan solved there), each layer's record written by `write(path, text, tmp_dir)` (the
    pipeline's atomic write). `log` gets a line before calibration, one when the first layer begins, progress
    within each layer (weights and experts solved, ETAs; at most one line every PROGRESS_SECONDS) and one per
    finished layer.

    `devices` (one device string or the run's device list): the calibration forward passes and the Hessians run
    on the first; each layer's solves (independent groups of experts, and plain linears) are shared among all of
    them by `Workers`, the result byte-identical to one worker's (see there). A family whose decoder layer
    transformers cannot build from the checkpoint is refused (QuantError) before calibration starts.

    `ranks` (a `quant.gptq.ranks.Ranks` of size > 1): this process is one of several, each on its own device
    (`devices`: that one), running its share of the calibration batches and solving the weights it owns (see
    `quant.gptq.ranks`); the bytes are one process's. Only rank 0 has a `store` (and `write`) and returns the
    SolvedWeights; the others return None."""
    import torch

    from quant.gptq.mtp import mtp_layers
    from quant.gptq.ranks import Ranks
    from quant.model_exec.layers import DecoderStack, meta_model

    devices = [devices] if isinstance(devices, str) else list(devices)
    ranks = ranks if ranks is not None else Ranks(device=devices[0])
    if ranks.threads is not None:
        from quant.process import set_threads

        set_threads(ranks.threads)  # every CPU rank at the same thread count, rank 0 too
    device = devices[0]
    dtype = torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    model = meta_model(src_path, ckpt, dtype)  # before any work: a family GPTQ cannot run is one line
    if store is not None:
        store.mkdir(exist_ok=True)
    log(_calibration_line(settings.calibration, devices, ranks.size))
    started = time.perf_counter()
    tokens = calibration_tokens(settings.calibration, src_path) if ranks.rank == 0 else None
    tokens = ranks.broadcast(tokens, 0, "sending the calibration tokens")
    comm0, comm_cpu0 = ranks.comm_s, ranks.comm_cpu_s  # waiting for the others is set-up, not communication
    # The batches as one process cuts them; this rank runs a contiguous share of them (all, with one rank).
    mine = ranks.share(-(-tokens.shape[0] // settings.batch))
    local = tokens[mine.start * settings.batch:mine.stop * settings.batch]
    stack = DecoderStack(src_path, ckpt, layer_returns, device, dtype, model)
    workers = Workers(devices)
    by_layer, mtp, mtp_jobs = _split_mtp_jobs(quantized_jobs_by_layer(plan), mtp_layers(ckpt))
    work = {i: _work(ckpt, by_layer.get(i, [])) for i in range(len(stack))}
    work.update({len(stack) + ref.k: _work(ckpt, mtp_jobs[ref.k]) for ref in mtp})
    progress = Progress(log, work, len(stack))
    timing: Counter = Counter()
    layers = _DecoderLayers(stack, ckpt, plan, settings, store, _run_key(digest, tokens, stack), write, progress,
                            workers, timing, log, started, ranks)
    with torch.no_grad(), workers:
        hidden = stack.capture(local, settings.batch) if local.shape[0] else []
        carry: list[dict] = [{} for _ in hidden]
        timing["gptq_calibration_s"] += time.perf_counter() - started - (ranks.comm_s - comm0)
        for index in range(len(stack)):
            hidden, carry = layers.run(index, by_layer.get(index, []), hidden, carry)
        if mtp:
            _solve_mtp(stack, mtp, mtp_jobs, local, hidden, plan, settings, store, layers.digest, write, progress,
                       workers, log, timing, ranks)
    timing["gptq_comm_s"] = ranks.comm_s - comm0
    _report_run(log, ranks, timing, len(stack), len(mtp), tokens.shape, time.perf_counter() - started,
                ranks.comm_cpu_s - comm_cpu0)
    ranks.solving = False
    if store is None:
        return None
    return SolvedWeights(store, len(stack), {k: timing[k] for k in PHASES})


def _report_run(log, ranks, timing: Counter, layers: int, mtp: int, shape, seconds: float, comm_cpu: float) -> None:
    """The run's closing line; on several ranks, every rank's phases (the balance; scripts/bench_gptq_ranks.py reads
    that line) and, with TIMING_ENV set, this rank's figures in a file of their own."""
    comm = (f"; {ranks.size} ranks, rank 0 sent {ranks.sent / 1e6:.1f} MB and received {ranks.received / 1e6:.1f} MB "
            f"in {timing['gptq_comm_s']:.1f} s of collectives" if ranks.size > 1 else "")
    log(f"gptq: {layers} decoder layers" + (f" + {mtp} MTP layer{'s' * (mtp > 1)}" if mtp else "")
        + f" in {seconds:.1f} s ({shape[0]} windows x {shape[1]} tokens){comm}")
    if ranks.size > 1:
        every = ranks.all_gather({**{k: timing[k] for k in PHASES}, "sent": ranks.sent, "received": ranks.received},
                                 "gathering the ranks' timings")
        log("gptq: per rank (0.." + f"{ranks.size - 1}): " + ", ".join(
            f"{k.removeprefix('gptq_').removesuffix('_s')} " + "/".join(f"{t[k]:.2f}" for t in every) + " s"
            for k in PHASES) + "; MB sent " + "/".join(f"{t['sent'] / 1e6:.2f}" for t in every)
            + ", received " + "/".join(f"{t['received'] / 1e6:.2f}" for t in every))
    if os.environ.get(TIMING_ENV):
        Path(f"{os.environ[TIMING_ENV]}.{ranks.rank}").write_text(json.dumps({
            "rank": ranks.rank, "ranks": ranks.size, "wall_s": {k: timing[k] for k in PHASES},
            "cpu_s": {**{k: timing["cpu:" + k] for k in PHASES if "cpu:" + k in timing}, "gptq_comm_s": comm_cpu},
            "sent": ranks.sent, "received": ranks.received}, sort_keys=True))


def _calibration_line(cal: CalibrationSettings, devices: list[str], ranks: int = 1) -> str:
    shared = f", solved on {len(devices)} workers ({','.join(devices)})" if len(devices) > 1 else ""
    where = (f"on {ranks} torch.distributed ranks (rank 0 on {devices[0]}), each running its share of the windows"
             if ranks > 1 else f"on {devices[0]}{shared}")
    return (f"gptq: calibration: {cal.samples} windows x {cal.seq_len} tokens ({cal.samples * cal.seq_len:,} tokens) "
            f"of {cal.data}, {where}; tokenizing, then running them to the first decoder layer")


def _split_mtp_jobs(by_layer: dict[int, list[TensorJob]], mtp: list) -> tuple[dict, list, dict]:
    """The quantized jobs of the main layers apart from those of the MTP layers `mtp` (`MtpLayerRef`s): (main
    layers' jobs by index, the MTP layers up to the last one with a quantized weight, their jobs by k)."""
    mtp_jobs = {ref.k: [j for jobs in by_layer.values() for j in jobs if ref.owns(j.source.name)] for ref in mtp}
    mtp_names = {j.output for jobs in mtp_jobs.values() for j in jobs}
    by_layer = {i: [j for j in jobs if j.output not in mtp_names] for i, jobs in by_layer.items()}
    mtp = [ref for ref in mtp if any(mtp_jobs[r.k] for r in mtp[ref.k:])]  # up to the last one quantized
    return by_layer, mtp, mtp_jobs


@dataclass
class _DecoderLayers:
    """The main decoder layers, one at a time: each loaded, solved (or its earlier solution resumed from the
    store), replaced by its quantized weights and run forward to give the next layer its inputs."""

    stack: object
    ckpt: object
    plan: Plan
    settings: GptqSettings
    store: Path
    digest: str                # the content key of what the next layer's solution is made from (_chained)
    write: object
    progress: "Progress"
    workers: "Workers"
    timing: Counter
    log: object
    started: float             # when calibration began (perf_counter)
    ranks: object              # quant.gptq.ranks.Ranks
    first: bool = True         # no layer solved yet (the first one solved says when it starts)

    def run(self, index: int, jobs: list[TensorJob], hidden: list, carry: list[dict]) -> tuple[list, list[dict]]:
        from quant.gptq.ranks import maybe_die

        stack, timing = self.stack, self.timing
        maybe_die(self.ranks, index)
        t0 = time.perf_counter()
        layer = stack.load_layer(index)
        self.digest = _chained(self.digest, stack.identity[index])
        timing["gptq_load_s"] += time.perf_counter() - t0
        solved, resumed = self._solution(index, layer, jobs, hidden, carry)
        with _Phase(timing, "gptq_apply_s", self.ranks):
            _apply_quantized(stack, index, layer, jobs, solved, self.plan.scale_mode)
        with _Phase(timing, "gptq_forward_s", self.ranks):
            hidden, carry = stack.forward(index, layer, hidden, carry)
        stack.release_layer(index)
        del layer
        elapsed = time.perf_counter() - t0
        eta = "" if resumed else self.progress.end_layer(index, elapsed)
        self.log(self._done_line(index, jobs, solved, resumed, elapsed, eta))
        return hidden, carry

    def _solution(self, index: int, layer, jobs: list[TensorJob], hidden: list, carry: list[dict]
                  ) -> tuple[dict, bool]:
        """(the layer's solution, resumed): an earlier run's for the same plan from the store, else solved now
        and saved there."""
        previous = _previous_solution(self.store, index, self.digest, self.ranks)
        if previous is not None:
            return previous, True
        if self.first:
            self.log(f"gptq: layer {index + 1}/{len(self.stack)}: starting ({len(jobs)} weights; calibration "
                     f"inputs ready after {time.perf_counter() - self.started:.1f} s)")
            self.first = False
        self.progress.begin_layer(index, jobs, {j.output: _job_work(self.ckpt, j) for j in jobs})
        solved = _solve_layer(self.stack, index, layer, jobs, hidden, carry, self.plan, self.settings,
                              self.progress.solved, self.workers, timing=self.timing, ranks=self.ranks)
        t1 = time.perf_counter()
        if self.store is not None:
            _save_layer_solution(self.store, index, solved, _layer_digest(self.digest, index), self.write)
        self.timing["gptq_save_s"] += time.perf_counter() - t1
        return solved, False

    def _done_line(self, index: int, jobs: list[TensorJob], solved: dict, resumed: bool, elapsed: float,
                   eta: str) -> str:
        n_gptq = sum(1 for r in solved["records"].values() if r["method"] == "gptq")
        passes = "" if resumed else _passes_text(solved)
        return (f"gptq: layer {index + 1}/{len(self.stack)} {'(resumed) ' if resumed else ''}{n_gptq} weights "
                f"solved, {len(jobs) - n_gptq} rounded to nearest{passes}, {elapsed:.1f} s{eta}")


def _solve_mtp(stack, mtp: list, mtp_jobs: dict, tokens, hidden: list, plan: Plan, settings: GptqSettings,
               store: Path | None, digest: str, write, progress: "Progress", workers: "Workers", log,
               timing: Counter | None = None, ranks=None) -> None:
    """Solve the MTP draft layers `mtp` (`quant.gptq.mtp.MtpLayerRef`, in order) after the main layers: `hidden`
    are the last main layer's outputs per calibration batch (of `tokens` [N, L], settings.batch windows each).
    Draft layer k at position t sees the final-norm hidden state at t (layer k > 0: draft layer k-1's output at
    t) and the embedding of token t+k+1, as the engines run it (`quant.model_exec.mtp`); its quantized weights are
    then replaced by their solved values before the next draft layer is fed its output. `timing` gets seconds per
    phase (PHASES). On several `ranks`, `tokens` and `hidden` are this rank's share of the batches."""
    import torch

    from quant.model_exec.mtp import MtpBlock

    timing = Counter() if timing is None else timing
    t0 = time.perf_counter()
    norm = stack.text.norm
    prev = [norm(h) for h in hidden]
    batches = [tokens[b:b + settings.batch] for b in range(0, tokens.shape[0], settings.batch)]
    timing["gptq_forward_s"] += time.perf_counter() - t0
    for ref in mtp:
        t0 = time.perf_counter()
        with stack.reader.hashing() as read:
            block = MtpBlock(stack, ref.names)
        digest = _chained(digest, read())
        timing["gptq_load_s"] += time.perf_counter() - t0
        t1 = time.perf_counter()
        jobs = mtp_jobs[ref.k]
        inputs = [block.inputs(tok[:, ref.k + 1:], h[:, :-1]) for tok, h in zip(batches, prev)]
        del prev
        timing["gptq_forward_s"] += time.perf_counter() - t1
        stem = f"mtp-{ref.k:05d}"
        previous = _previous_solution(store, stem, digest, ranks)
        name = f"MTP layer {ref.block.rstrip('.')}"

        def slot_of(job, block=block):
            return block.slot(job.source.name, job.source.expert, job.source.rows)

        if previous is not None:
            solved, resumed = previous, True
        else:
            index = len(stack) + ref.k
            progress.begin_layer(index, jobs, {j.output: _job_work(stack.ckpt, j) for j in jobs}, name=name)

            def run_pass(block=block, inputs=inputs):
                return (block.run(z, positions) for z, positions in inputs)

            solved = _solve_layer(stack, index, block.layer, jobs, [], [], plan, settings, progress.solved, workers,
                                  slot_of=slot_of, run_pass=run_pass, timing=timing, ranks=ranks)
            t1 = time.perf_counter()
            if store is not None:
                _save_layer_solution(store, stem, solved, _layer_digest(digest, stem), write)
            timing["gptq_save_s"] += time.perf_counter() - t1
            resumed = False
        with _Phase(timing, "gptq_apply_s", ranks):
            _apply_quantized(stack, None, block.layer, jobs, solved, plan.scale_mode, slot_of=slot_of)
        with _Phase(timing, "gptq_forward_s", ranks), torch.no_grad():
            prev = [block.run(z, positions) for z, positions in inputs] if ref is not mtp[-1] else []
        del inputs, block
        elapsed = time.perf_counter() - t0
        eta = "" if resumed else progress.end_layer(len(stack) + ref.k, elapsed)
        n_gptq = sum(1 for r in solved["records"].values() if r["method"] == "gptq")
        passes = "" if resumed else _passes_text(solved)
        log(f"gptq: {name} {'(resumed) ' if resumed else ''}{n_gptq} weights solved, {len(jobs) - n_gptq} rounded "
            f"to nearest{passes}, {elapsed:.1f} s{eta}")


def _passes_text(solved: dict) -> str:
    """How a layer's Hessians were collected: one process's calibration passes (forwards over every window), or on
    several ranks one forward over each rank's share and the sweeps of the owned Hessians over its inputs."""
    if "sweeps" in solved:
        sweeps = solved["sweeps"]
        return f", 1 calibration pass per rank, {sweeps} Hessian sweep{'s' * (sweeps != 1)} per rank at most"
    return f", {solved['passes']} calibration pass{'es' * (solved['passes'] != 1)}"


def _previous_solution(store: Path | None, index: int | str, digest: str, ranks=None) -> dict | None:
    """An earlier run's solution of layer `index` for the same plan, from the store (rank 0 reads it; on several
    ranks it is broadcast to the others, which have no store), or None."""
    solution = None
    if store is not None:
        record_path = _layer_file(store, index, ".json")
        previous = json.loads(record_path.read_text()) if record_path.is_file() else None
        if previous and previous.get("digest") == _layer_digest(digest, index):
            solution = _load_layer_solution(store, index, previous)
    if ranks is not None and ranks.size > 1:
        solution = ranks.broadcast(solution, 0, "resuming the finished layers")
    return solution


def _job_work(ckpt, job: TensorJob) -> float:
    """A weight's share of its layer's solve time, as a proxy: R K (R + K) for its [R, K] matrix (the column loop
    is R K^2 and the Hessian's factorisation K^3, per expert)."""
    info = ckpt.tensors.get(job.source.name)
    if info is None or len(info.shape) < 2:
        return 1.0
    k = info.shape[-1]
    r = job.source.rows[1] - job.source.rows[0] if job.source.rows else info.shape[-2]
    return float(r) * k * (r + k)


def _work(ckpt, jobs: list[TensorJob]) -> float:
    return sum(_job_work(ckpt, j) for j in jobs if j.scheme in MXFP4_SCHEMES)


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """Progress lines within and between layers. Work is `_job_work` summed over MXFP4 weights; the ETAs divide
    the work left by the rate of the layers finished in this run (or, in the first layer, of the weights solved
    so far in it, forward passes included)."""

    def __init__(self, log, work_by_layer: dict[int, float], layers: int, every: float | None = None):
        self.log, self.work_by_layer, self.layers = log, work_by_layer, layers
        self.every = PROGRESS_SECONDS if every is None else every
        self.done_work = self.done_time = 0.0  # layers finished (solved, not resumed) in this run

    def begin_layer(self, index: int, jobs: list[TensorJob], work: dict[str, float], name: str | None = None
                    ) -> None:
        self.index, self.t0, self.last = index, time.perf_counter(), time.perf_counter()
        self.name = name or f"layer {index + 1}/{self.layers}"
        eligible = [j for j in jobs if j.scheme in MXFP4_SCHEMES]
        self.work = {j.output: work.get(j.output, 1.0) for j in eligible}
        self.layer_work = sum(self.work.values()) or 1.0
        self.layer_done = 0.0
        self.total, self.solved_jobs = len(eligible), 0
        self.experts: dict[str, int] = defaultdict(int)  # expert -> its weights not yet solved
        for j in eligible:
            expert = _expert_of(j)
            if expert is not None:
                self.experts[expert] += 1
        self.experts_total = len(self.experts)

    def _rate(self, layer_elapsed: float) -> float | None:
        if self.done_work > 0:
            return self.done_time / self.done_work
        if self.layer_done > 0:
            return layer_elapsed / self.layer_done
        return None

    def _left_after(self, index: int) -> float:
        return sum(w for i, w in self.work_by_layer.items() if i > index)

    def solved(self, jobs: list[TensorJob]) -> None:
        """`jobs` of the current layer are solved (or rounded to nearest)."""
        jobs = [j for j in jobs if j.output in self.work]
        if not jobs:
            return
        for job in jobs:
            self.layer_done += self.work.pop(job.output)
            self.solved_jobs += 1
            expert = _expert_of(job)
            if expert is not None and expert in self.experts:
                self.experts[expert] -= 1
        now = time.perf_counter()
        if now - self.last < self.every or not self.work:
            return
        self.last = now
        elapsed = now - self.t0
        line = f"gptq: {self.name}: {self.solved_jobs}/{self.total} weights done"
        if self.experts_total:
            done = sum(1 for left in self.experts.values() if left <= 0)
            line += f" (experts {done}/{self.experts_total})"
        line += f", {_duration(elapsed)} in"
        layer_rate = elapsed / self.layer_done if self.layer_done else None
        if layer_rate is not None:
            layer_left = (self.layer_work - self.layer_done) * layer_rate
            line += f"; layer ETA {_duration(layer_left)}"
            rate = self._rate(elapsed)
            line += f", run ETA {_duration(layer_left + self._left_after(self.index) * rate)}"
        self.log(line)

    def end_layer(self, index: int, elapsed: float) -> str:
        """Books a finished layer; returns the run's ETA as a suffix for the layer's line."""
        self.done_work += self.work_by_layer.get(index, 0.0)
        self.done_time += elapsed
        left = self._left_after(index)
        rate = self._rate(elapsed)
        if left <= 0 or rate is None:
            return ""
        return f"; run ETA {_duration(left * rate)}"


def _expert_of(job: TensorJob) -> str | None:
    """"model.layers.3.mlp.experts.17" for a routed expert's weight (per-expert names or fused slices)."""
    if job.source.expert is not None:
        return f"{job.source.name.rsplit('.', 1)[0]}.{job.source.expert}"
    m = _EXPERT.match(job.output)
    return m.group(1) if m else None


class Workers:
    """The devices that share each layer's solves: worker i solves on devices[i], in a thread of its own (torch
    releases the GIL inside its kernels, so CPU workers share the cores and CUDA workers drive their own GPUs).
    With one device everything runs in the calling thread, as before.

    The result does not depend on the number of workers, byte for byte: what is solved together (a plain
    linear, or a group of experts of one fused parameter) is decided by the tensors and the settings alone
    (`solve_groups`), never by the workers; each group is solved from the same fp32 weights and Hessians, by the same
    code, wherever it runs; and the groups' results are merged in one fixed order. Which worker solves which
    group is a deterministic greedy balance of estimated costs (largest first, to the least loaded worker), so
    the manifest's `worker` records repeat between runs on the same devices. CPU workers each get
    `process.cpu_threads(workers)` intra-op threads (OpenMP keeps the count per thread), one worker keeps the
    caller's; so no result may depend on the thread count: the float64 Cholesky factorisation, whose MKL rounding
    does, always runs on one thread (`solve._one_cpu_thread`; tests/test_gptq_determinism.py). Devices of one kind
    give identical bytes; a CPU worker beside CUDA ones would not (different kernels)."""

    def __init__(self, devices: list[str]):
        self.devices = list(devices)
        self.pool = None

    def __enter__(self) -> "Workers":
        from concurrent.futures import ThreadPoolExecutor

        if len(self.devices) > 1:
            self.pool = ThreadPoolExecutor(len(self.devices), thread_name_prefix="gptq-worker")
        return self

    def __exit__(self, *exc) -> bool:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        return False

    def assign(self, costs: list[float]) -> list[int]:
        """The worker of each task: largest estimated cost first, each to the least loaded worker (lowest index
        on ties; `ranks.balance`, as the ranks share a layer's weights)."""
        from quant.gptq.ranks import balance

        return balance(costs, len(self.devices))

    def run(self, tasks: list, costs: list[float]) -> list[tuple[int, object]]:
        """Run `tasks` (callables taking the worker's device string); returns (worker, result) in task order. The
        first failure stops every worker at its next task and is raised here."""
        owner = self.assign(costs)
        if self.pool is None or len(tasks) < 2:
            return [(owner[i], task(self.devices[owner[i]])) for i, task in enumerate(tasks)]
        import threading

        import torch

        from quant.process import cpu_threads, set_threads

        all_cpu = all(torch.device(d).type == "cpu" for d in self.devices)
        threads = cpu_threads(len(self.devices)) if all_cpu else None
        failed = threading.Event()

        def loop(w: int) -> list[tuple[int, object]]:
            device = self.devices[w]
            if threads is not None:
                set_threads(threads)
            if torch.device(device).type == "cuda" and torch.device(device).index is not None:
                torch.cuda.set_device(torch.device(device))
            done = []
            try:
                with torch.no_grad():
                    for i in (i for i in range(len(tasks)) if owner[i] == w):
                        if failed.is_set():
                            break
                        done.append((i, tasks[i](device)))
            except BaseException:
                failed.set()
                raise
            return done

        futures = [self.pool.submit(loop, w) for w in range(len(self.devices)) if w in owner]
        results: list = [None] * len(tasks)
        error = None
        for future in futures:  # every worker has stopped before anything is raised
            try:
                for i, result in future.result():
                    results[i] = (owner[i], result)
            except BaseException as e:  # a worker's failure, or an interrupt of this thread while it waits
                failed.set()
                error = error or e
        if error is not None:
            raise error
        return results


def solve_groups(param, count: int, settings: GptqSettings) -> list[list[int]]:
    """The groups of a parameter's `count` matrices solved together: as many as keep the solver's working set
    (float64 Cholesky factors, fp32 weights) within settings.solve_bytes. A function of the tensor's shape and
    the settings only (never of the workers), so every run batches the same matrices together."""
    k = param.shape[-1]
    group = max(1, settings.solve_bytes // (k * k * 8 * 3 + param.shape[-2] * k * 4 * 4))
    return [list(range(g0, min(g0 + group, count))) for g0 in range(0, count, group)]


def expert_modules(fused: dict[str, tuple[int, list[int]]]) -> list[tuple[list[str], list[int], int]]:
    """A layer's fused expert modules, from `fused` (parameter key -> (input features, experts solved)): per module
    (the keys sharing its path), its keys, the experts solved in any of them, and one expert's fp32 Hessians in
    bytes."""
    modules = []
    for path in sorted({k.rsplit(".", 1)[0] for k in fused}):
        mine = [k for k in fused if k.rsplit(".", 1)[0] == path]
        modules.append((mine, sorted({e for k in mine for e in fused[k][1]}), sum(fused[k][0] ** 2 * 4 for k in mine)))
    return modules


def hessian_passes(plain: list[str], fused: dict[str, tuple[int, list[int]]], budget: int
                   ) -> list[tuple[list[str], list[int] | None]]:
    """A layer's calibration passes (each a forward over every calibration window), as (the parameter keys whose
    Hessians it collects, the experts it collects them for; None when it holds no fused expert parameter): each
    fused module's experts (`expert_modules`) in passes of at most `budget` bytes of Hessians, the plain linears
    `plain` riding along with the first pass (one pass per layer when every expert fits). What `_solve_layer` runs
    and the dry run predicts."""
    passes: list[tuple[list[str], list[int] | None]] = []
    for keys, experts, per_expert in expert_modules(fused):
        chunk = max(1, budget // per_expert)
        passes += [(keys, experts[i:i + chunk]) for i in range(0, len(experts), chunk)]
    if plain:
        passes[:1] = [(plain + passes[0][0], passes[0][1])] if passes else [(plain, None)]
    return passes


def _group_cost(param, size: int) -> float:
    """A group's estimated solve time, for balancing the workers: R K (R + K) per matrix, plus the column loop's
    fixed cost per column (small kernels: launch and interpreter time dominate toy sizes)."""
    r, k = param.shape[-2], param.shape[-1]
    return float(size) * r * k * (r + k) + 2e5 * k


def _solve_layer(stack, index: int, layer, jobs: list[TensorJob], hidden: list, carry: list[dict], plan: Plan,
                 settings: GptqSettings, progress=None, workers: Workers | None = None, slot_of=None,
                 run_pass=None, timing: Counter | None = None, ranks=None) -> dict:
    """GPTQ for the MXFP4 weights of one layer. Returns {"records": {output: record}, "parts": {output: parts}}.
    `progress(jobs)` is called as groups of weights are solved. The Hessians are collected on the layer's device;
    the solves of each pass are shared among `workers` (default: one, the layer's device), each solved weight's
    record naming its worker and device. `slot_of(job)` (default: the stack's slot of the job in layer `index`)
    and `run_pass()` (an iterable that runs the layer over every calibration batch; default: layer `index` of the
    stack over `hidden` and `carry`) let an MTP draft layer (`_solve_mtp`) be solved by the same code. `timing`
    gets the seconds of the Hessian passes and of the solves (gptq_hessians_s, gptq_solve_s). On several `ranks`
    (`_solve_layer_ranked`) each rank runs `run_pass` over its share of the batches and solves the weights it
    owns; the records and parts are every rank's, the same bytes as one process's."""
    import threading

    from quant.gptq.hessians import HessianCollector, supported

    progress = progress or (lambda jobs: None)
    lock = threading.Lock()

    def report(done: list[TensorJob]) -> None:  # from the worker threads
        with lock:
            progress(done)

    records: dict[str, dict] = {}
    parts: dict[str, dict] = {}
    slot_of = slot_of or (lambda job: stack.slot(index, job.source.name, job.source.expert, job.source.rows))
    run_pass = run_pass or (lambda: stack.run_layer(index, layer, hidden, carry))
    slots = {job.output: slot_of(job) for job in jobs}
    eligible = [j for j in jobs if j.scheme in MXFP4_SCHEMES]
    for job in jobs:
        if job.scheme not in MXFP4_SCHEMES:
            records[job.output] = {"method": "rtn", "why": f"{job.scheme} (GPTQ here is for MXFP4 weights)"}
    keys = sorted({slots[j.output].key for j in eligible})
    unsupported = [k for k in keys if not supported(layer, k)]
    for job in eligible:
        if slots[job.output].key in unsupported:
            records[job.output] = {"method": "rtn", "why": "neither an nn.Linear nor a fused expert parameter"}
    progress([j for j in eligible if slots[j.output].key in unsupported])
    keys = [k for k in keys if k not in unsupported]

    plain = [k for k in keys if layer.get_parameter(k).dim() == 2]
    fused = {k: (layer.get_parameter(k).shape[-1], [slots[j.output].expert for j in eligible
                                                    if slots[j.output].key == k])
             for k in keys if k not in plain}
    passes = hessian_passes(plain, fused, settings.hessian_bytes)

    workers = workers or Workers([stack.device])
    timing = Counter() if timing is None else timing
    if ranks is not None and ranks.size > 1:
        return _solve_layer_ranked(layer, eligible, slots, plain, passes, records, parts, plan, settings, report,
                                   workers, run_pass, timing, ranks)
    for pass_keys, pass_experts in passes:
        with _Phase(timing, "gptq_hessians_s", ranks):
            collector = HessianCollector(layer, set(pass_keys), pass_experts)
            try:
                for _ in run_pass():
                    pass
            finally:
                collector.close()
        tasks, costs = [], []
        for key in pass_keys:
            experts = None if key in plain else pass_experts
            hessians, counts = collector.hessians.pop(key), collector.tokens[key]
            jobs_here = [j for j in eligible if slots[j.output].key == key
                         and (experts is None or slots[j.output].expert in experts)]
            param = layer.get_parameter(key)
            for sel in solve_groups(param, counts.shape[0], settings):
                tasks.append(functools.partial(_solve_group, param, experts, sel, hessians, counts, jobs_here, slots,
                                               plan.scale_mode, settings, report))
                costs.append(_group_cost(param, len(sel)))
        del collector
        _run_solves(workers, tasks, costs, timing, ranks, records, parts)
        del tasks
    return {"records": records, "parts": parts, "passes": len(passes)}


def _run_solves(workers: Workers, tasks: list, costs: list[float], timing: Counter, ranks, records: dict,
                parts: dict, rank: int | None = None) -> None:
    """Run solve tasks (`_solve_group`) on `workers` into `records` and `parts`, each solved weight's record naming
    its worker and device, and on several ranks its `rank`."""
    with _Phase(timing, "gptq_solve_s", ranks):
        results = workers.run(tasks, costs)
    for worker, (group_records, group_parts) in results:
        for record in group_records.values():
            if record["method"] == "gptq":
                record.update(**({} if rank is None else {"rank": rank}), worker=worker,
                              device=workers.devices[worker])
        records.update(group_records)
        parts.update(group_parts)


@dataclass(frozen=True)
class _Unit:
    """One solve of a layer, what one process solves together: a plain linear (`experts` None), or one group of a
    fused expert parameter's experts (`solve_groups` within one calibration pass of `hessian_passes`)."""

    key: str
    experts: tuple[int, ...] | None


def _units(layer, plain: list[str], passes: list, settings: GptqSettings) -> list[_Unit]:
    units = []
    for pass_keys, pass_experts in passes:
        for key in pass_keys:
            if key in plain:
                units.append(_Unit(key, None))
                continue
            for sel in solve_groups(layer.get_parameter(key), len(pass_experts), settings):
                units.append(_Unit(key, tuple(pass_experts[i] for i in sel)))
    return units


def _unit_cost(layer, unit: _Unit, counts: dict) -> float:
    """A unit's estimated work at its owner, for balancing the ranks: accumulating its Hessians (tokens x K^2, and
    for down_proj the gate_up product that makes its inputs) and solving them (R K (R + K) + K^3 per matrix)."""
    param = layer.get_parameter(unit.key)
    r, k = param.shape[-2], param.shape[-1]
    if unit.experts is None:
        return float(counts[unit.key]) * k * k + r * k * (r + k) + k ** 3
    path = unit.key.rsplit(".", 1)[0]
    tokens = sum(int(counts[path][e]) for e in unit.experts)
    gate_up = layer.get_parameter(f"{path}.gate_up_proj")
    extra = 0 if unit.key.endswith("gate_up_proj") else gate_up.shape[-2] * gate_up.shape[-1]
    return float(tokens) * (k * k + extra) + len(unit.experts) * (r * k * (r + k) + k ** 3)


def _sweeps(units: list[_Unit], layer, budget: int) -> list[list[_Unit]]:
    """A rank's units in sweeps over the layer's calibration inputs: the plain linears in the first, the groups of
    experts in as few sweeps as keep each one's fp32 Hessians within `budget` (at least one group a sweep)."""
    sweeps, current, held = [], [u for u in units if u.experts is None], 0
    for unit in (u for u in units if u.experts is not None):
        size = len(unit.experts) * layer.get_parameter(unit.key).shape[-1] ** 2 * 4
        if held and held + size > budget:
            sweeps.append(current)
            current, held = [], 0
        current.append(unit)
        held += size
    return sweeps + [current] if current else sweeps


def _routed_counts(layer, batches: list[dict], plain: list[str], keys: list[str]) -> dict:
    """What this rank's batches hold, for the balance: the batches, each plain linear's input rows, and per fused
    experts module the tokens routed to each expert (exact integers, summed over the ranks)."""
    import torch

    counts: dict = {"batches": len(batches)}
    for key in plain:
        counts[key] = sum(x.numel() // x.shape[-1] for b in batches for x in b["linear"].get(key, []))
    for path in sorted({k.rsplit(".", 1)[0] for k in keys if k not in plain}):
        gate_up = layer.get_parameter(f"{path}.gate_up_proj")
        n = torch.zeros(gate_up.shape[0], dtype=torch.int64)
        for b in batches:
            for hidden_states, top_k in b["experts"].get(path, []):
                routed = top_k.reshape(hidden_states.numel() // gate_up.shape[-1], -1).long()
                mask = torch.zeros(routed.shape[0], gate_up.shape[0], dtype=torch.bool)
                n += mask.scatter_(1, routed, True).sum(dim=0)
        counts[path] = n
    return counts


class _Phase:
    """Adds a block's seconds to timing[name], and the process's CPU seconds to timing["cpu:" + name], less what
    this rank spent in collectives meanwhile (those are gptq_comm_s; `ranks` None: one process, none)."""

    def __init__(self, timing: Counter, name: str, ranks=None):
        self.timing, self.name, self.ranks = timing, name, ranks

    def _comm(self) -> tuple[float, float]:
        return (self.ranks.comm_s, self.ranks.comm_cpu_s) if self.ranks is not None else (0.0, 0.0)

    def __enter__(self):
        self.t0, self.cpu0, self.c0 = time.perf_counter(), time.process_time(), self._comm()
        return self

    def __exit__(self, *exc) -> bool:
        wall, cpu = self._comm()
        self.timing[self.name] += time.perf_counter() - self.t0 - (wall - self.c0[0])
        self.timing["cpu:" + self.name] += time.process_time() - self.cpu0 - (cpu - self.c0[1])
        return False


def _unit_tasks(chunk: list, collector, layer, eligible: list[TensorJob], slots: dict, plan: Plan,
                settings: GptqSettings, report) -> tuple[list, list]:
    """The solves of this rank's units in one sweep, from the Hessians its collector summed, and their costs."""
    tasks, costs = [], []
    for u in chunk:
        param = layer.get_parameter(u.key)
        if u.experts is None:
            hessians, n = collector.hessians.pop(u.key), collector.tokens[u.key]
            jobs_here = [j for j in eligible if slots[j.output].key == u.key]
            experts_list = None
        else:
            where = collector.expert_slots(u.key)
            index = [where[e] for e in u.experts]
            hessians, n = collector.hessians[u.key][index], collector.tokens[u.key][index]
            experts_list = list(u.experts)
            jobs_here = [j for j in eligible if slots[j.output].key == u.key and slots[j.output].expert in u.experts]
        sel = list(range(n.shape[0]))
        tasks.append(functools.partial(_solve_group, param, experts_list, sel, hessians, n, jobs_here, slots,
                                       plan.scale_mode, settings, report))
        costs.append(_group_cost(param, len(sel)))
    return tasks, costs


def _solve_layer_ranked(layer, eligible: list[TensorJob], slots: dict, plain: list[str], passes: list,
                        records: dict, parts: dict, plan: Plan, settings: GptqSettings, report, workers: Workers,
                        run_pass, timing: Counter, ranks) -> dict:
    """`_solve_layer` on several ranks (`quant.gptq.ranks`): this rank runs the layer over its batches, keeping
    the inputs of every weight to solve (`hessians.InputRecorder`); the units (`_units`: exactly one process's
    solves) get owners balanced by their cost (`_unit_cost`, from the routed-token counts of all ranks); then, in
    sweeps (`_sweeps`), every batch in the global order goes from its holder to the owners that need it and each
    owner feeds its `HessianCollector` as the hooks would have, and solves its units. The solved weights are
    gathered to every rank, in rank order; each record of a solved weight names its `rank`."""
    from quant.gptq.hessians import HessianCollector, InputRecorder

    if not passes:  # nothing to solve here (every rank knows it): no forward either, as with one process
        return {"records": records, "parts": parts, "passes": 0, "sweeps": 0}
    keys = sorted({k for pass_keys, _ in passes for k in pass_keys})
    with _Phase(timing, "gptq_hessians_s", ranks):
        recorder = InputRecorder(layer, set(keys))
        try:
            batches = iter(run_pass())
            while True:
                recorder.next_batch()
                if next(batches, None) is None:
                    break
        finally:
            recorder.close()
        recorder.batches.pop()
        local_counts = _routed_counts(layer, recorder.batches, plain, keys)
    gathered = ranks.all_gather(local_counts, "counting the routed tokens")
    counts = {name: sum(c[name] for c in gathered) for name in local_counts}
    units = _units(layer, plain, passes, settings)
    owners = ranks.assign([_unit_cost(layer, u, counts) for u in units])
    sweeps = {r: _sweeps([u for u, o in zip(units, owners) if o == r], layer, settings.hessian_bytes)
              for r in range(ranks.size)}
    rounds = [(r, i) for r in range(ranks.size) for i in range(gathered[r]["batches"])]  # the global batch order
    mine_records: dict[str, dict] = {}
    mine_parts: dict[str, dict] = {}
    for s in range(max(len(v) for v in sweeps.values())):
        needs = {r: ({u.key for u in sweeps[r][s] if u.experts is None},
                     {u.key.rsplit(".", 1)[0] for u in sweeps[r][s] if u.experts is not None})
                 for r in range(ranks.size) if s < len(sweeps[r])}
        receivers = sorted(needs)
        chunk = sweeps[ranks.rank][s] if s < len(sweeps[ranks.rank]) else []
        with _Phase(timing, "gptq_hessians_s", ranks):
            experts: dict[str, set] = {}
            for u in chunk:
                if u.experts is not None:
                    experts.setdefault(u.key, set()).update(u.experts)
            collector = HessianCollector(layer, {u.key for u in chunk}, experts, hooks=False) if chunk else None
            for src, i in rounds:
                payloads = None
                if src == ranks.rank:
                    batch, shared = recorder.batches[i], {}  # ranks that need the same get the same object
                    payloads = {r: shared.setdefault((tuple(sorted(lin)), tuple(sorted(mods))), {
                        "linear": {k: batch["linear"].get(k, []) for k in sorted(lin)},
                        "experts": {p: batch["experts"].get(p, []) for p in sorted(mods)}})
                        for r, (lin, mods) in needs.items()}
                got = ranks.deliver(payloads, src, receivers, "sending the calibration activations to their owners")
                if got is not None and collector is not None:
                    collector.feed(got)
        tasks, costs = _unit_tasks(chunk, collector, layer, eligible, slots, plan, settings, report)
        del collector
        _run_solves(workers, tasks, costs, timing, ranks, mine_records, mine_parts, rank=ranks.rank)
        del tasks
    del recorder
    for piece in ranks.all_gather({"records": mine_records, "parts": mine_parts}, "gathering the solved weights"):
        records.update(piece["records"])
        parts.update(piece["parts"])
    return {"records": records, "parts": parts, "passes": len(passes),
            "sweeps": max(len(v) for v in sweeps.values())}


def _solve_group(param, experts: list[int] | None, sel: list[int], hessians, counts, jobs: list[TensorJob],
                 slots: dict, scale_mode: str, settings: GptqSettings, progress, device: str
                 ) -> tuple[dict, dict]:
    """Solve the matrices `sel` (indices into `hessians` [E, K, K] and `counts` [E]) of one layer parameter (a
    linear's weight, or rows `experts[i]` of fused experts) on `device`; returns the records and parts of the
    `jobs` they hold, and reports those jobs to `progress`."""
    import torch

    from quant.gptq.solve import gptq_mxfp4, output_error
    from quant.numerics import mxfp4

    records: dict[str, dict] = {}
    parts: dict[str, dict] = {}
    k = param.shape[-1]
    g0 = sel[0]
    w = (param.unsqueeze(0) if experts is None else param[[experts[i] for i in sel]]).to(device=device,
                                                                                       dtype=torch.float32)
    h, n = hessians[sel].to(device), counts[sel]
    ok = n >= (MIN_EXPERT_TOKENS if experts is not None else 1)
    # Fewer tokens than inputs: a rank-deficient H, damped in proportion (up to its whole mean diagonal).
    damp = torch.where(ok & (n < k), torch.clamp(settings.damp * k / n.clamp_min(1), max=1.0),
                       torch.full((len(sel),), settings.damp))
    eye = torch.eye(k, device=h.device).expand_as(h)
    h = torch.where(ok.to(h.device)[:, None, None], h, eye)  # identity H: rounds to nearest exactly
    solved = gptq_mxfp4(w, h, scale_mode, damp.to(h.device))
    err_gptq = output_error(w, solved.values, h)
    rtn = mxfp4.dequantize_mxfp4(*mxfp4.quantize_mxfp4(w, mode=scale_mode), dtype=torch.float32)
    err_rtn = output_error(w, rtn, h)
    done = []
    for job in jobs:
        slot = slots[job.output]
        i = 0 if experts is None else experts.index(slot.expert) - g0
        if not 0 <= i < len(sel):
            continue
        done.append(job)
        r0, r1 = slot.rows if slot.rows else (0, w.shape[1])
        tokens = int(n[i])
        if not bool(ok[i]):
            records[job.output] = {"method": "rtn", "tokens": tokens,
                                   "why": f"{tokens} calibration tokens (< {MIN_EXPERT_TOKENS})"}
            continue
        records[job.output] = {"method": "gptq", "tokens": tokens, "damping": float(solved.damping[i]),
                               "calib_rel_error_rtn": float(err_rtn[i]),
                               "calib_rel_error_gptq": float(err_gptq[i])}
        # copies of their own (a view would carry the whole group's storage wherever it is pickled to: ranks)
        parts[job.output] = {"weight": solved.packed[i, r0:r1].to("cpu", copy=True),
                             "weight_scale": solved.scales[i, r0:r1].to("cpu", copy=True)}
    del h, solved, rtn, w
    progress(done)
    return records, parts


def _save_layer_solution(store: Path, index: int | str, solved: dict, digest: str, write) -> None:
    from safetensors.torch import save_file

    tensors = {f"{out}.{s}": t for out, p in solved["parts"].items() for s, t in p.items()}
    weights = _layer_file(store, index, ".safetensors")
    tmp = weights.with_suffix(".safetensors.partial")
    save_file(tensors, str(tmp))
    tmp.replace(weights)
    # The record last: it is what marks the layer solved.
    write(_layer_file(store, index, ".json"),
          json.dumps({"digest": digest, "weights": solved["records"]}, sort_keys=True), store)


def _load_layer_solution(store: Path, index: int | str, record: dict) -> dict:
    from safetensors import safe_open

    parts: dict[str, dict] = {}
    with safe_open(str(_layer_file(store, index, ".safetensors")), framework="pt") as f:
        for out, rec in record["weights"].items():
            if rec["method"] == "gptq":
                parts[out] = {s: f.get_tensor(f"{out}.{s}") for s in ("weight", "weight_scale")}
    return {"records": record["weights"], "parts": parts}


def _apply_quantized(stack, index: int | None, layer, jobs: list[TensorJob], solved: dict, scale_mode: str,
                     slot_of=None) -> None:
    """Replace every quantized weight of the layer by the values the engines will compute with (GPTQ's, or the
    scheme's round-to-nearest), so the next layer calibrates on the quantized model's activations."""
    import torch

    from quant.planning.schemes import SCHEMES

    params = dict(layer.named_parameters())
    for job in jobs:
        slot = slot_of(job) if slot_of else stack.slot(index, job.source.name, job.source.expert, job.source.rows)
        if slot.key not in params:
            continue  # not a weight of the layer (MTP glue): nothing the next layer computes with
        param = layer.get_parameter(slot.key)
        target = param if slot.expert is None else param[slot.expert]
        if slot.rows:
            target = target[slot.rows[0]:slot.rows[1]]
        scheme = SCHEMES[job.scheme]
        parts = solved["parts"].get(job.output)
        if parts is None:
            parts = scheme.quantize(target.detach().to(torch.float32), scale_mode)
        target.copy_(scheme.dequantize({k: v.to(param.device) for k, v in parts.items()}).to(param.dtype))
