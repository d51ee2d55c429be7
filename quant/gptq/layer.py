"""One decoder layer's GPTQ solve (`solve_layer`): one implementation, for one process and for several ranks.

The layer's MXFP4 weights are cut into solve units (`schedule.layer_schedule`: a plain linear, or one group of a
fused expert parameter's experts, as one process groups them). Their input Hessians are collected in rounds, each
into a `hessians.HessianCollector` for the units of that round; then the round's units are solved on the workers
(`_solve_group`) and, at the end, what each rank solved is gathered to every rank in rank order. What differs is
only how a round's Hessians are fed (`_Passes`, `_Sweeps`):
  - one process (the one rank): a round is one calibration pass (`schedule.hessian_passes`), the layer's forward
    over every calibration batch with the collector's hooks on;
  - several ranks (`quant.gptq.ranks`): one forward over this rank's batches records the inputs of every weight to
    solve (`hessians.InputRecorder`); the units get owners balanced by their cost (`schedule.unit_cost`, from the
    routed-token counts of every rank); a round is one sweep of a rank's owned units (`schedule.sweeps`), in which
    every batch, in the global order, goes from its holder to the owners that need it.
Either way each H is the same fp32 additions in the same order, and each unit is solved by the same code from the
same weights: the bytes are one process's whatever the number of ranks or workers.

What stays round-to-nearest here: FP8-scheme modules of mixed recipes (GPTQ here is the MXFP4 grid's), weights that
are neither an nn.Linear nor a fused expert parameter, and routed experts fewer than `MIN_EXPERT_TOKENS`
calibration tokens were routed to. Experts with at least that many but fewer tokens than input columns get
damping scaled up by columns / tokens."""

from __future__ import annotations

import functools
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from quant.gptq.hessians import HessianCollector, InputRecorder, supported
from quant.gptq.progress import Phase
from quant.gptq.schedule import LayerSchedule, Unit, Workers, group_cost, layer_schedule, sweeps, unit_cost
from quant.gptq.solve import gptq_mxfp4, output_error
from quant.numerics import mxfp4
from quant.planning.plan import TensorJob
from quant.planning.schemes import MXFP4_SCHEMES

# Routed experts that fewer calibration tokens were routed to stay round-to-nearest: their Hessian is too poorly
# estimated to steer the rounding (the damping would dominate it). Part of the settings' identity (settings.py).
MIN_EXPERT_TOKENS = 64


@dataclass
class LayerContext:
    """What every layer's solve of a run shares: the settings and the checkpoint's scale rule, the workers, the
    timing (seconds per `progress.PHASES`), this process's place among the ranks (`ranks.Ranks`; size 1: one
    process) and `progress(jobs)`, told of the weights as they are solved (or rounded to nearest)."""

    settings: Any  # a quant.gptq.settings.GptqSettings (which imports this module)
    scale_mode: str
    workers: Workers
    timing: Counter
    ranks: object
    progress: Callable = lambda jobs: None


def solve_layer(layer, jobs: list[TensorJob], slot_of, run_pass, ctx: LayerContext) -> dict:
    """GPTQ for the MXFP4 weights `jobs` of `layer` (a main decoder layer, or an MTP draft's): {"records": {output:
    record}, "parts": {output: {"weight", "weight_scale"}}, "passes": one process's calibration passes, and on
    several ranks "sweeps": the most Hessian sweeps of a rank}. `slot_of(job)` is the job's place in the layer
    (`model_exec.layers.Slot`), `run_pass()` an iterable that runs the layer over this rank's calibration batches.
    Each solved weight's record names its worker and device, and on several ranks its rank."""
    lock = threading.Lock()

    def report(done: list[TensorJob]) -> None:  # from the worker threads
        with lock:
            ctx.progress(done)

    slots = {job.output: slot_of(job) for job in jobs}
    records, eligible, plain, fused = _solvable(layer, jobs, slots, ctx.progress)
    schedule = layer_schedule(layer, plain, fused, ctx.settings)
    ranked = ctx.ranks.size > 1
    solved = {"records": records, "parts": {}, "passes": len(schedule.passes), **({"sweeps": 0} if ranked else {})}
    if not schedule.passes:  # nothing to solve here (every rank knows it): no forward either
        return solved
    feed = (_Sweeps if ranked else _Passes)(layer, schedule, plain, run_pass, ctx)
    mine_records: dict[str, dict] = {}
    mine_parts: dict[str, dict] = {}
    for s in range(feed.count):
        chunk, collector = feed.collect(s)
        tasks, costs = _unit_tasks(chunk, collector, layer, eligible, slots, ctx, report)
        del collector
        _run_solves(ctx, tasks, costs, mine_records, mine_parts)
        del tasks
    solved.update(feed.summary())
    del feed
    for piece in ctx.ranks.all_gather({"records": mine_records, "parts": mine_parts}, "gathering the solved weights"):
        solved["records"].update(piece["records"])
        solved["parts"].update(piece["parts"])
    return solved


def _solvable(layer, jobs: list[TensorJob], slots: dict, progress) -> tuple[dict, list, list[str], dict]:
    """(the records of the jobs that stay round-to-nearest, the MXFP4 jobs, the plain linears to solve, the fused
    expert parameters to solve: key -> the experts solved in it)."""

    records: dict[str, dict] = {}
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
    fused = {k: [slots[j.output].expert for j in eligible if slots[j.output].key == k] for k in keys if k not in plain}
    return records, eligible, plain, fused


def _experts_of(chunk: list[Unit]) -> dict[str, set]:
    """The experts each fused parameter of `chunk` collects Hessians for."""
    experts: dict[str, set] = {}
    for u in chunk:
        if u.experts is not None:
            experts.setdefault(u.key, set()).update(u.experts)
    return experts


class _Passes:
    """One process's rounds: the calibration passes, each a forward over every batch with the hooks on."""

    def __init__(self, layer, schedule: LayerSchedule, plain: list[str], run_pass, ctx: LayerContext):
        self.layer, self.rounds, self.run_pass, self.ctx = layer, schedule.rounds, run_pass, ctx
        self.count = len(self.rounds)

    def collect(self, s: int):
        chunk = self.rounds[s]
        with Phase(self.ctx.timing, "gptq_hessians_s", self.ctx.ranks):
            collector = HessianCollector(self.layer, {u.key for u in chunk}, _experts_of(chunk))
            try:
                for _ in self.run_pass():
                    pass
            finally:
                collector.close()
        return chunk, collector

    def summary(self) -> dict:
        return {}


class _Sweeps:
    """A rank's rounds: one forward over its batches recording the solved weights' inputs, the units' owners
    balanced by cost, then the sweeps of its owned units, each fed every batch in the global order by the rank
    that holds it."""

    def __init__(self, layer, schedule: LayerSchedule, plain: list[str], run_pass, ctx: LayerContext):
        self.layer, self.ranks = layer, ctx.ranks
        self.timing = ctx.timing
        keys = sorted({k for pass_keys, _ in schedule.passes for k in pass_keys})
        local_counts = self._record(keys, plain, run_pass)
        gathered = self.ranks.all_gather(local_counts, "counting the routed tokens")
        counts = {name: sum(c[name] for c in gathered) for name in local_counts}
        units = schedule.units
        owners = self.ranks.assign([unit_cost(layer, u, counts) for u in units])
        self.sweeps = {r: sweeps([u for u, o in zip(units, owners) if o == r], layer, ctx.settings.hessian_bytes)
                       for r in range(self.ranks.size)}
        self.order = [(r, i) for r in range(self.ranks.size) for i in range(gathered[r]["batches"])]  # global order
        self.count = max(len(v) for v in self.sweeps.values())

    def _record(self, keys: list[str], plain: list[str], run_pass) -> dict:
        """Runs the layer over this rank's batches, keeping the inputs of `keys`; returns the routed counts."""

        with Phase(self.timing, "gptq_hessians_s", self.ranks):
            self.recorder = InputRecorder(self.layer, set(keys))
            try:
                batches = iter(run_pass())
                while True:
                    self.recorder.next_batch()
                    if next(batches, None) is None:
                        break
            finally:
                self.recorder.close()
            self.recorder.batches.pop()
            return _routed_counts(self.layer, self.recorder.batches, plain, keys)

    def collect(self, s: int):
        ranks = self.ranks
        needs = {r: ({u.key for u in self.sweeps[r][s] if u.experts is None},
                     {u.key.rsplit(".", 1)[0] for u in self.sweeps[r][s] if u.experts is not None})
                 for r in range(ranks.size) if s < len(self.sweeps[r])}
        receivers = sorted(needs)
        chunk = self.sweeps[ranks.rank][s] if s < len(self.sweeps[ranks.rank]) else []
        with Phase(self.timing, "gptq_hessians_s", ranks):
            collector = HessianCollector(self.layer, {u.key for u in chunk}, _experts_of(chunk),
                                         hooks=False) if chunk else None
            for src, i in self.order:
                payloads = self._payloads(i, needs) if src == ranks.rank else None
                got = ranks.deliver(payloads, src, receivers, "sending the calibration activations to their owners")
                if got is not None and collector is not None:
                    collector.feed(got)
        return chunk, collector

    def _payloads(self, i: int, needs: dict) -> dict:
        """What each rank that needs them gets of recorded batch `i` (ranks that need the same get one object)."""
        batch, shared = self.recorder.batches[i], {}
        return {r: shared.setdefault((tuple(sorted(lin)), tuple(sorted(mods))), {
            "linear": {k: batch["linear"].get(k, []) for k in sorted(lin)},
            "experts": {p: batch["experts"].get(p, []) for p in sorted(mods)}})
            for r, (lin, mods) in needs.items()}

    def summary(self) -> dict:
        return {"sweeps": self.count}


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


def _group_hessians(collector, unit: Unit):
    """A group's Hessians [G, K, K] and token counts [G] from the collector: a view where its experts' slots are
    contiguous (always, on one process), else a copy."""
    where = collector.expert_slots(unit.key)
    index = [where[e] for e in unit.experts]
    hessians, tokens = collector.hessians[unit.key], collector.tokens[unit.key]
    if index == list(range(index[0], index[0] + len(index))):
        return hessians[index[0]:index[0] + len(index)], tokens[index[0]:index[0] + len(index)]
    return hessians[index], tokens[index]


def _unit_tasks(chunk: list[Unit], collector, layer, eligible: list[TensorJob], slots: dict, ctx: LayerContext,
                report) -> tuple[list, list]:
    """The solves of one round's units, from the Hessians its collector summed, and their costs."""
    tasks, costs = [], []
    for u in chunk:
        param = layer.get_parameter(u.key)
        if u.experts is None:
            hessians, counts = collector.hessians.pop(u.key), collector.tokens[u.key]
            jobs_here = [j for j in eligible if slots[j.output].key == u.key]
        else:
            hessians, counts = _group_hessians(collector, u)
            jobs_here = [j for j in eligible if slots[j.output].key == u.key and slots[j.output].expert in u.experts]
        tasks.append(functools.partial(_solve_group, param, u.experts, hessians, counts, jobs_here, slots,
                                       ctx.scale_mode, ctx.settings, report))
        costs.append(group_cost(param, u.size()))
    return tasks, costs


def _run_solves(ctx: LayerContext, tasks: list, costs: list[float], records: dict, parts: dict) -> None:
    """Run solve tasks (`_solve_group`) on the workers into `records` and `parts`, each solved weight's record
    naming its worker and device, and on several ranks its `rank`."""
    workers = ctx.workers
    with Phase(ctx.timing, "gptq_solve_s", ctx.ranks):
        results = workers.run(tasks, costs)
    rank = {"rank": ctx.ranks.rank} if ctx.ranks.size > 1 else {}
    for worker, (group_records, group_parts) in results:
        for record in group_records.values():
            if record["method"] == "gptq":
                record.update(**rank, worker=worker, device=workers.devices[worker])
        records.update(group_records)
        parts.update(group_parts)


def _solve_group(param, experts: tuple[int, ...] | None, hessians, counts, jobs: list[TensorJob], slots: dict,
                 scale_mode: str, settings, progress, device: str) -> tuple[dict, dict]:
    """Solve one unit on `device`: a linear's weight (`experts` None), or the rows `experts` of fused experts, from
    their Hessians [G, K, K] and token counts [G]; returns the records and parts of the `jobs` they hold, and
    reports those jobs to `progress`."""
    import torch


    records: dict[str, dict] = {}
    parts: dict[str, dict] = {}
    k = param.shape[-1]
    w = (param.unsqueeze(0) if experts is None else param[list(experts)]).to(device=device, dtype=torch.float32)
    h, n = hessians.to(device), counts
    ok = n >= (MIN_EXPERT_TOKENS if experts is not None else 1)
    # Fewer tokens than inputs: a rank-deficient H, damped in proportion (up to its whole mean diagonal).
    damp = torch.where(ok & (n < k), torch.clamp(settings.damp * k / n.clamp_min(1), max=1.0),
                       torch.full((n.shape[0],), settings.damp))
    eye = torch.eye(k, device=h.device).expand_as(h)
    h = torch.where(ok.to(h.device)[:, None, None], h, eye)  # identity H: rounds to nearest exactly
    solved = gptq_mxfp4(w, h, scale_mode, damp.to(h.device))
    err_gptq = output_error(w, solved.values, h)
    rtn = mxfp4.dequantize_mxfp4(*mxfp4.quantize_mxfp4(w, mode=scale_mode), dtype=torch.float32)
    err_rtn = output_error(w, rtn, h)
    done = []
    for job in jobs:
        slot = slots[job.output]
        if experts is not None and slot.expert not in experts:
            continue
        i = 0 if experts is None else experts.index(slot.expert)
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
