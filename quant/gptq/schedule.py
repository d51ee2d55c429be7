"""What GPTQ's work is made of, and who does it: the quantized jobs of each decoder layer, how a layer's Hessians
are collected (one process's calibration passes, `hessian_passes`; a rank's sweeps over its recorded inputs,
`sweeps`) and solved (the solve units, `solve_groups`), the cost model that balances workers and ranks
(`job_work`, `group_cost`, `unit_cost`), and the `Workers` that share a layer's solves among devices.

`layer_schedule` is the one cut of a layer into passes and solve units: the run solves by it
(`quant.gptq.layer`) and the dry run predicts by it (`quant.gptq.dry_run`), so they cannot disagree. Everything
here is a function of the tensors' shapes and the settings alone (never of the workers or ranks), which is what
keeps the solved bytes the same on any number of them."""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from quant.gptq.ranks import balance
from quant.planning.plan import Plan, TensorJob
from quant.planning.schemes import MXFP4_SCHEMES
from quant.planning.treatment import LAYER
from quant.process import cpu_threads, set_threads


# -- the jobs of each layer ------------------------------------------------------------------------------------
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


def split_mtp_jobs(by_layer: dict[int, list[TensorJob]], mtp: list) -> tuple[dict, list, dict]:
    """The quantized jobs of the main layers apart from those of the MTP layers `mtp` (`MtpLayerRef`s): (main
    layers' jobs by index, the MTP layers up to the last one with a quantized weight, their jobs by k)."""
    mtp_jobs = {ref.k: [j for jobs in by_layer.values() for j in jobs if ref.owns(j.source.name)] for ref in mtp}
    mtp_names = {j.output for jobs in mtp_jobs.values() for j in jobs}
    by_layer = {i: [j for j in jobs if j.output not in mtp_names] for i, jobs in by_layer.items()}
    mtp = [ref for ref in mtp if any(mtp_jobs[r.k] for r in mtp[ref.k:])]  # up to the last one quantized
    return by_layer, mtp, mtp_jobs


def job_work(ckpt, job: TensorJob) -> float:
    """A weight's share of its layer's solve time, as a proxy: R K (R + K) for its [R, K] matrix (the column loop
    is R K^2 and the Hessian's factorisation K^3, per expert)."""
    info = ckpt.tensors.get(job.source.name)
    if info is None or len(info.shape) < 2:
        return 1.0
    k = info.shape[-1]
    r = job.source.rows[1] - job.source.rows[0] if job.source.rows else info.shape[-2]
    return float(r) * k * (r + k)


def work(ckpt, jobs: list[TensorJob]) -> float:
    return sum(job_work(ckpt, j) for j in jobs if j.scheme in MXFP4_SCHEMES)


# -- a layer's passes and solve units ---------------------------------------------------------------------------
def solve_groups(param, count: int, settings) -> list[list[int]]:
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
    `plain` riding along with the first pass (one pass per layer when every expert fits)."""
    passes: list[tuple[list[str], list[int] | None]] = []
    for keys, experts, per_expert in expert_modules(fused):
        chunk = max(1, budget // per_expert)
        passes += [(keys, experts[i:i + chunk]) for i in range(0, len(experts), chunk)]
    if plain:
        passes[:1] = [(plain + passes[0][0], passes[0][1])] if passes else [(plain, None)]
    return passes


@dataclass(frozen=True)
class Unit:
    """One solve of a layer, what one process solves together: a plain linear (`experts` None), or one group of a
    fused expert parameter's experts (`solve_groups` within one calibration pass of `hessian_passes`)."""

    key: str
    experts: tuple[int, ...] | None

    def size(self) -> int:
        return 1 if self.experts is None else len(self.experts)


@dataclass(frozen=True)
class LayerSchedule:
    """A layer's GPTQ work as one process cuts it: its calibration passes (`hessian_passes`) and, per pass, the
    solve units whose Hessians that pass collects (`rounds`, in solve order)."""

    passes: list[tuple[list[str], list[int] | None]]
    rounds: list[list[Unit]]

    @property
    def units(self) -> list[Unit]:
        return [u for r in self.rounds for u in r]


def layer_schedule(layer, plain: list[str], fused: dict[str, list[int]], settings) -> LayerSchedule:
    """The passes and solve units of `layer` (a module; on the meta device for the dry run) whose plain linears
    `plain` and fused expert parameters `fused` (key -> the experts solved) GPTQ solves, under settings'
    hessian_bytes and solve_bytes."""
    inputs = {k: (layer.get_parameter(k).shape[-1], experts) for k, experts in fused.items()}
    passes = hessian_passes(list(plain), inputs, settings.hessian_bytes)
    rounds = []
    for pass_keys, pass_experts in passes:
        units = []
        for key in pass_keys:
            if key in plain:
                units.append(Unit(key, None))
                continue
            for sel in solve_groups(layer.get_parameter(key), len(pass_experts), settings):
                units.append(Unit(key, tuple(pass_experts[i] for i in sel)))
        rounds.append(units)
    return LayerSchedule(passes, rounds)


def sweeps(units: list[Unit], layer, budget: int) -> list[list[Unit]]:
    """A rank's units in sweeps over the layer's calibration inputs: the plain linears in the first, the groups of
    experts in as few sweeps as keep each one's fp32 Hessians within `budget` (at least one group a sweep)."""
    out, current, held = [], [u for u in units if u.experts is None], 0
    for unit in (u for u in units if u.experts is not None):
        size = len(unit.experts) * layer.get_parameter(unit.key).shape[-1] ** 2 * 4
        if held and held + size > budget:
            out.append(current)
            current, held = [], 0
        current.append(unit)
        held += size
    return out + [current] if current else out


# -- the cost model ---------------------------------------------------------------------------------------------
def group_cost(param, size: int) -> float:
    """A group's estimated solve time, for balancing the workers: R K (R + K) per matrix, plus the column loop's
    fixed cost per column (small kernels: launch and interpreter time dominate toy sizes)."""
    r, k = param.shape[-2], param.shape[-1]
    return float(size) * r * k * (r + k) + 2e5 * k


def unit_cost(layer, unit: Unit, counts: dict) -> float:
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


# -- the workers ------------------------------------------------------------------------------------------------
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
    does, always runs on one thread (`solve.one_cpu_thread`; tests/test_gptq_determinism.py). Devices of one kind
    give identical bytes; a CPU worker beside CUDA ones would not (different kernels)."""

    def __init__(self, devices: list[str]):
        self.devices = list(devices)
        self.pool = None

    def __enter__(self) -> "Workers":
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

        return balance(costs, len(self.devices))

    def run(self, tasks: list, costs: list[float]) -> list[tuple[int, object]]:
        """Run `tasks` (callables taking the worker's device string); returns (worker, result) in task order. The
        first failure stops every worker at its next task and is raised here."""
        owner = self.assign(costs)
        if self.pool is None or len(tasks) < 2:
            return [(owner[i], task(self.devices[owner[i]])) for i, task in enumerate(tasks)]

        failed = threading.Event()
        futures = [self.pool.submit(self._loop, w, tasks, owner, failed) for w in range(len(self.devices))
                   if w in owner]
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

    def _loop(self, w: int, tasks: list, owner: list[int], failed) -> list[tuple[int, object]]:
        """Worker `w`'s thread: its tasks in order, until one fails here or in another worker (`failed`)."""
        import torch


        device = self.devices[w]
        if all(torch.device(d).type == "cpu" for d in self.devices):
            set_threads(cpu_threads(len(self.devices)))
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
