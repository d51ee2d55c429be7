"""What a GPTQ run says and measures: the line before calibration, progress lines within and between layers with
their ETAs (`Progress`), the seconds of each phase (`PHASES`, `Phase`) and the run's closing lines
(`report_run`)."""

from __future__ import annotations

import re
import time
from collections import Counter, defaultdict

from quant.planning.plan import TensorJob
from quant.planning.schemes import MXFP4_SCHEMES

PROGRESS_SECONDS = 10.0  # at most one progress line this often within a layer
_EXPERT = re.compile(r"^(.*\bexperts\.\d+)\.")
# The phases of a GPTQ run, as `SolvedWeights.timing` (and the manifest's `timing`) name their seconds: tokenizing
# the calibration text and running it to the first decoder layer; reading each layer's weights; the forward passes
# that accumulate the input Hessians; the solves (all workers, wall time); saving each layer's solution;
# replacing the layer's weights by their quantized values (apply: the whole layer, on every rank); and running the
# calibration activations through it to the next layer (the MTP layers' inputs included).
# On several ranks (`quant.gptq.ranks`), the seconds a rank waited in its collectives are `gptq_comm_s`, not counted
# in the phase they happened in.
PHASES = ("gptq_calibration_s", "gptq_load_s", "gptq_hessians_s", "gptq_solve_s", "gptq_save_s", "gptq_apply_s",
          "gptq_forward_s", "gptq_comm_s")


class Phase:
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


def calibration_line(cal, devices: list[str], ranks: int = 1) -> str:
    shared = f", solved on {len(devices)} workers ({','.join(devices)})" if len(devices) > 1 else ""
    where = (f"on {ranks} torch.distributed ranks (rank 0 on {devices[0]}), each running its share of the windows"
             if ranks > 1 else f"on {devices[0]}{shared}")
    return (f"gptq: calibration: {cal.samples} windows x {cal.seq_len} tokens ({cal.samples * cal.seq_len:,} tokens) "
            f"of {cal.data}, {where}; tokenizing, then running them to the first decoder layer")


def report_run(log, ranks, timing: Counter, layers: int, mtp: int, shape, seconds: float, comm_cpu: float) -> None:
    """The run's closing line; on several ranks, every rank's phases (the balance; scripts/bench_gptq_ranks.py reads
    that line)."""
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


def timing_record(ranks, timing: Counter, comm_cpu: float) -> dict:
    """This rank's figures (one process: rank 0 of 1), JSON-ready: its seconds per phase (`wall_s`), the CPU seconds
    of the phases that count them (`cpu_s`; gptq_comm_s: `comm_cpu`, the CPU seconds of its collectives) and the
    bytes its collectives sent and received."""
    return {"rank": ranks.rank, "ranks": ranks.size, "wall_s": {k: timing[k] for k in PHASES},
            "cpu_s": {**{k: timing["cpu:" + k] for k in PHASES if "cpu:" + k in timing}, "gptq_comm_s": comm_cpu},
            "sent": ranks.sent, "received": ranks.received}


def layer_line(name: str, solved: dict, jobs: int, resumed: bool, elapsed: float, eta: str) -> str:
    """A finished layer's line: weights solved and rounded to nearest, how its Hessians were collected, seconds."""
    n_gptq = sum(1 for r in solved["records"].values() if r["method"] == "gptq")
    passes = "" if resumed else _passes_text(solved)
    return (f"gptq: {name} {'(resumed) ' if resumed else ''}{n_gptq} weights solved, {jobs - n_gptq} rounded to "
            f"nearest{passes}, {elapsed:.1f} s{eta}")


def _passes_text(solved: dict) -> str:
    """How a layer's Hessians were collected: one process's calibration passes (forwards over every window), or on
    several ranks one forward over each rank's share and the sweeps of the owned Hessians over its inputs."""
    if "sweeps" in solved:
        sweeps = solved["sweeps"]
        return f", 1 calibration pass per rank, {sweeps} Hessian sweep{'s' * (sweeps != 1)} per rank at most"
    return f", {solved['passes']} calibration pass{'es' * (solved['passes'] != 1)}"


def duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """Progress lines within and between layers. Work is `schedule.job_work` summed over MXFP4 weights; the ETAs
    divide the work left by the rate of the layers finished in this run (or, in the first layer, of the weights
    solved so far in it, forward passes included)."""

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
        self.log(self._line(now - self.t0))

    def _line(self, elapsed: float) -> str:
        line = f"gptq: {self.name}: {self.solved_jobs}/{self.total} weights done"
        if self.experts_total:
            done = sum(1 for left in self.experts.values() if left <= 0)
            line += f" (experts {done}/{self.experts_total})"
        line += f", {duration(elapsed)} in"
        layer_rate = elapsed / self.layer_done if self.layer_done else None
        if layer_rate is not None:
            layer_left = (self.layer_work - self.layer_done) * layer_rate
            line += f"; layer ETA {duration(layer_left)}"
            rate = self._rate(elapsed)
            line += f", run ETA {duration(layer_left + self._left_after(self.index) * rate)}"
        return line

    def end_layer(self, index: int, elapsed: float) -> str:
        """Books a finished layer; returns the run's ETA as a suffix for the layer's line."""
        self.done_work += self.work_by_layer.get(index, 0.0)
        self.done_time += elapsed
        left = self._left_after(index)
        rate = self._rate(elapsed)
        if left <= 0 or rate is None:
            return ""
        return f"; run ETA {duration(left * rate)}"


def _expert_of(job: TensorJob) -> str | None:
    """"model.layers.3.mlp.experts.17" for a routed expert's weight (per-expert names or fused slices)."""
    if job.source.expert is not None:
        return f"{job.source.name.rsplit('.', 1)[0]}.{job.source.expert}"
    m = _EXPERT.match(job.output)
    return m.group(1) if m else None
