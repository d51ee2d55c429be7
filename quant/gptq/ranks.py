"""GPTQ on torch.distributed ranks (issue #34): one process per device, on one machine or several, launched by
`torchrun --nproc-per-node N -m quant quantize SRC OUT --method gptq` (the same command on every node) or, on one
machine, `quant quantize ... --ranks N`.

What each rank does (`quant.gptq.layer`, whose one process is the one-rank case of the same solve):
  - data-parallel forwards: the calibration batches are cut as one process cuts them (settings.batch windows
    each) and each rank takes a contiguous share (`Ranks.share`); it runs the embedding and every decoder layer on
    its share only, and keeps its share's activations from layer to layer (nothing is gathered between layers);
  - owned Hessians: every quantized weight of a layer (a plain linear, or one solve group of a fused expert
    parameter: `schedule.solve_groups`, the groups one process solves) has an owner rank, balanced by its estimated
    cost (the routed-token counts of its experts x in_features^2, and the solve); while a rank runs the layer on
    its batches it keeps the inputs each owned weight needs (a linear's input rows; an experts module's hidden
    states and top-k indices); then, batch by batch in the global order, the holder sends each owner its share
    (`Ranks.deliver`) and the owner accumulates H exactly as one process does (`hessians.accumulate_*`): the same
    fp32 additions in the same order, so H and every solve are byte-identical whatever the number of ranks;
  - the solves of the owned weights on the rank's device; the solved codes and scales are gathered to every rank
    (`Ranks.all_gather`) in rank order, each rank applies the whole quantized layer and runs its share forward;
  - only rank 0 touches OUT: it plans, writes each solved layer to OUT/.quant-gptq/ (resumable: a relaunch reads
    the finished layers there and broadcasts them), the shards and the manifest, whose `method` record names the
    `rank` that solved each weight. The other ranks take the plan and the calibration tokens from rank 0
    (`follow`), so they need the source checkpoint at the same path and nothing else.

Communication is gloo (pickled CPU tensors; on GPUs the payloads are staged through host memory). Every collective
has a timeout (QUANT_RANK_TIMEOUT seconds, default 1800): a killed or hung peer ends the run with one line
(`RankLost`, exit 75) instead of a hang; the ranks that only lost a peer stay silent, so the line is rank 0's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

from quant.checkpoint import open_checkpoint
from quant.errors import QuantError, RankLost

TIMEOUT_ENV = "QUANT_RANK_TIMEOUT"
DEFAULT_TIMEOUT_S = 1800.0


def launched() -> bool:
    """Whether this process is one of several ranks (torchrun's WORLD_SIZE > 1)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        raise QuantError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r}: not a number (set by torchrun)") from None


def _timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise QuantError(f"{TIMEOUT_ENV}={raw!r}: must be a positive number of seconds")
    return value


@dataclass
class Ranks:
    """This process's place among the ranks (`size` 1: a single process, no collective runs), and what the
    collectives moved: payload bytes this rank sent and received, and the seconds it spent in them."""

    rank: int = 0
    size: int = 1
    device: str = "cpu"
    timeout_s: float = DEFAULT_TIMEOUT_S
    sent: int = 0
    received: int = 0
    comm_s: float = 0.0
    comm_cpu_s: float = 0.0  # the process's CPU seconds meanwhile (pickling, copies)
    threads: int | None = None  # intra-op threads of a CPU rank (the machine's cores shared among its ranks)
    solving: bool = False  # rank 0: the others have been handed the run and not yet finished it

    # -- set-up ------------------------------------------------------------------------------------------
    @classmethod
    def from_env(cls) -> "Ranks":
        """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); the
        rank's device is cuda:LOCAL_RANK where that GPU exists, else the CPU."""
        import torch
        import torch.distributed as dist

        size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
        timeout = _timeout_s()
        cuda = torch.cuda.is_available() and local < torch.cuda.device_count()
        device = f"cuda:{local}" if cuda else "cpu"
        if cuda:
            torch.cuda.set_device(local)
        try:
            dist.init_process_group("gloo", timeout=timedelta(seconds=timeout), rank=rank, world_size=size)
        except (RuntimeError, ValueError) as e:
            raise RankLost(f"GPTQ rank {rank} of {size}: cannot join the other ranks at "
                           f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')} "
                           f"({_first_line(e)})") from None
        threads = None
        if device == "cpu":  # the machine's cores shared among the ranks on it
            from quant.process import cpu_threads, set_threads

            threads = cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
            set_threads(threads)
        return cls(rank, size, device, timeout, threads=threads)

    def close(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()

    # -- the split -------------------------------------------------------------------------------------------
    def share(self, count: int, rank: int | None = None) -> range:
        """The calibration batches (of `count`) rank `rank` (default this one) runs: a contiguous share."""
        r = self.rank if rank is None else rank
        return range(r * count // self.size, (r + 1) * count // self.size)

    def holder(self, batch: int, count: int) -> int:
        return next(r for r in range(self.size) if batch in self.share(count, r))

    def assign(self, costs: list[float]) -> list[int]:
        """The owner rank of each item (`balance`): a function of the costs and the rank count alone, so every
        rank computes the same owners."""
        return balance(costs, self.size)

    # -- collectives -----------------------------------------------------------------------------------------
    def broadcast(self, obj=None, src: int = 0, what: str = "a broadcast"):
        """`obj` of rank `src`, on every rank (tensors in it on the CPU)."""
        if self.size == 1:
            return obj
        import torch
        import torch.distributed as dist

        with self._guard(what):
            data = _encode(obj) if self.rank == src else None
            size = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64)
            dist.broadcast(size, src)
            if data is None:
                data = torch.empty(int(size), dtype=torch.uint8)
            dist.broadcast(data, src)
            self._count(data.numel(), src)
            return obj if self.rank == src else _decode(data)

    def all_gather(self, obj, what: str = "gathering the solved weights") -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        import torch
        import torch.distributed as dist

        with self._guard(what):
            data = _encode(obj)
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
            dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64))
            most = max(int(s) for s in sizes)
            padded = torch.zeros(most, dtype=torch.uint8)
            padded[:data.numel()] = data
            chunks = [torch.empty(most, dtype=torch.uint8) for _ in range(self.size)]
            dist.all_gather(chunks, padded)
            self.sent += data.numel() * (self.size - 1)
            self.received += sum(int(s) for r, s in enumerate(sizes) if r != self.rank)
            return [obj if r == self.rank else _decode(chunks[r][:int(sizes[r])]) for r in range(self.size)]

    def deliver(self, payloads: dict | None, src: int, receivers: list[int], what: str = "sending activations"):
        """One point-to-point round: rank `src` sends `payloads[dst]` to each rank of `receivers` (their order);
        returns what this rank gets (its own payload when it is `src`; None when it is not a receiver)."""
        if self.rank == src:
            payloads = payloads or {}
            if self.size == 1:
                return payloads.get(self.rank)
            import torch
            import torch.distributed as dist

            with self._guard(what):
                works, buffers, encoded = [], [], {}  # the buffers stay alive until their sends are done
                for dst in receivers:
                    if dst == src:
                        continue
                    payload = payloads.get(dst)  # one encoding of a payload several ranks are sent
                    data = encoded[id(payload)] if id(payload) in encoded else encoded.setdefault(
                        id(payload), _encode(payload))
                    size = torch.tensor([data.numel()], dtype=torch.int64)
                    buffers += [size, data]
                    works += [dist.isend(size, dst, tag=1), dist.isend(data, dst, tag=2)]
                    self.sent += data.numel()
                for work in works:
                    work.wait(timedelta(seconds=self.timeout_s))
                del buffers
            return payloads.get(self.rank)
        if self.rank not in receivers:
            return None
        import torch
        import torch.distributed as dist

        with self._guard(what):
            size = torch.zeros(1, dtype=torch.int64)
            dist.irecv(size, src, tag=1).wait(timedelta(seconds=self.timeout_s))
            data = torch.empty(int(size), dtype=torch.uint8)
            dist.irecv(data, src, tag=2).wait(timedelta(seconds=self.timeout_s))
            self.received += data.numel()
            return _decode(data)

    def _count(self, nbytes: int, src: int) -> None:
        if self.rank == src:
            self.sent += nbytes * (self.size - 1)
        else:
            self.received += nbytes

    def _guard(self, what: str):
        return _Guard(self, what)


def balance(costs: list[float], bins: int) -> list[int]:
    """The bin of each item: largest estimated cost first, each to the least loaded bin (lowest on ties)."""
    loads = [0.0] * bins
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        b = min(range(bins), key=lambda b: (loads[b], b))
        owner[i] = b
        loads[b] += costs[i]
    return owner


class _Guard:
    """Times a collective, and turns a lost peer (gloo's connection errors, a timeout) into one `RankLost` line."""

    def __init__(self, ranks: Ranks, what: str):
        self.ranks, self.what = ranks, what

    def __enter__(self):
        self.t0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, kind, e, tb) -> bool:
        self.ranks.comm_s += time.perf_counter() - self.t0
        self.ranks.comm_cpu_s += time.process_time() - self.cpu0
        if e is not None and isinstance(e, RuntimeError):
            r = self.ranks
            raise RankLost(f"GPTQ rank {r.rank} of {r.size}: a peer rank stopped answering while {self.what} "
                           f"({_why(e, r.timeout_s)}); the layers solved so far are kept in OUT/.quant-gptq/: run "
                           f"the same command again to resume") from None
        return False


def _why(e: BaseException, timeout_s: float) -> str:
    """gloo's error, in words: a lost connection, or no answer within the timeout."""
    text = str(e).lower()
    if "timed out" in text or "timeout" in text:
        return f"no answer within {timeout_s:g} s, {TIMEOUT_ENV}"
    if any(w in text for w in ("connection reset", "connection closed", "broken pipe", "connection refused", "eof")):
        return "its connection was lost"
    return _first_line(e)[:120]


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _encode(obj):
    import torch

    raw = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)


def _decode(data):
    return pickle.loads(data.numpy().tobytes())


# -- the command's two roles --------------------------------------------------------------------------------
def follow(ranks: Ranks, solve_checkpoint) -> None:
    """A rank other than 0: wait for rank 0's work and do its share, until rank 0 says it is done. Rank 0 sends
    ("solve", what `run.solve_checkpoint` needs) once its pipeline has planned a GPTQ run, then ("done",). The
    command hands `solve_checkpoint` in (run.py builds on this module, not the other way round)."""
    import transformers  # noqa: F401  (its import, seconds, overlaps rank 0's planning)


    while True:
        message = ranks.broadcast(None, 0, "waiting for rank 0's plan")
        if message[0] == "prepare":  # rank 0 checked the source and plans: build its model meanwhile (imports)
            from quant.model_exec.layers import meta_model

            meta_model(message[1], open_checkpoint(message[1]))
            continue
        if message[0] != "solve":
            return
        work = message[1]
        ckpt = open_checkpoint(work["src_path"])
        mine = dataclasses.replace(work["settings"], ranks=ranks)  # rank 0's settings: the same solves
        solve_checkpoint(work["plan"], ckpt, work["src_path"], None, [ranks.device], mine, work["layer_returns"],
                         work["digest"], None, lambda m: None, ranks=ranks)


def lead_prepare(ranks: Ranks, src_path) -> None:
    """Rank 0 has checked the source (`GptqSettings.check`) and goes on planning: the others build the model from
    it meanwhile, so that transformers' imports and the model's construction are not waited for later."""
    ranks.broadcast(("prepare", src_path), 0, "sending the source")


def lead_solve(ranks: Ranks, request, settings) -> None:
    """Rank 0's side of `follow`: hand the other ranks the run (the plan, the source, rank 0's GPTQ settings)."""
    ranks.solving = True
    ranks.broadcast(("solve", {"plan": request.plan, "src_path": request.src_path, "digest": request.digest,
                               "layer_returns": request.layer_returns,
                               "settings": dataclasses.replace(settings, ranks=None)}), 0, "sending the plan")


def lead_done(ranks: Ranks) -> None:
    """Rank 0 is done (or failed before or after the solve): the other ranks may go. Best effort: a rank that is
    gone already cannot be told."""
    try:
        ranks.broadcast(("done",), 0, "finishing")
    except RankLost:
        pass


# Set by `--ranks`' own launcher (launch_local), which names a lost rank itself in one line.
LOCAL_LAUNCHER_ENV = "QUANT_RANKS_LAUNCHER"


def say_when_stopped(ranks: Ranks) -> None:
    """Under torchrun: when one rank fails or is killed, torchrun's agent stops every other rank with SIGTERM, which
    would end them without a word (torchrun then prints its own failure report and exits 1). Each rank stopped so
    says it in one `error:` line and exits 75 (RankLost: the finished layers are kept, the same command resumes).
    The line is written from a thread woken by the signal's wakeup fd, so it comes also while the main thread waits
    inside a collective (a Python signal handler runs only once the main thread is back in the interpreter)."""

    if os.environ.get(LOCAL_LAUNCHER_ENV) or threading.current_thread() is not threading.main_thread():
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.signal(signal.SIGTERM, lambda *_: None)  # the wakeup fd is written only for a signal with a handler
    signal.set_wakeup_fd(write)

    def watch() -> None:
        while signal.SIGTERM not in os.read(read, 64):
            pass
        sys.stderr.write(f"error: GPTQ rank {ranks.rank} of {ranks.size}: stopped by the launcher (SIGTERM: another "
                         f"rank failed or was killed); the layers solved so far are kept in OUT/.quant-gptq/: run "
                         f"the same command again to resume\n")
        sys.stderr.flush()
        os._exit(RankLost.exit_code)

    threading.Thread(target=watch, name="quant-sigterm", daemon=True).start()


def run_command(ranks: Ranks, lead, solve_checkpoint) -> None:
    """The quantize command on one of several ranks: rank 0 runs `lead()` (the pipeline, whose GPTQ solver hands
    the others the run: `lead_solve`), then releases them (`lead_done`; also when it fails before or after the
    solve, so they never wait for a run that will not come). The others `follow` with `solve_checkpoint`
    (run.solve_checkpoint). A rank other than 0 that only
    lost a peer exits 75 without a line (rank 0's line says it); any other failure of theirs names the rank. A
    rank 0 that fails in the middle of the solve just ends: the others lose it and stop."""
    import typer

    say_when_stopped(ranks)
    if ranks.rank != 0:
        try:
            follow(ranks, solve_checkpoint)
        except RankLost:
            raise typer.Exit(RankLost.exit_code) from None
        except QuantError as e:
            raise e.__class__(f"GPTQ rank {ranks.rank} of {ranks.size}: {e}") from None
        ranks.close()
        return
    try:
        lead()
    except BaseException:
        if not ranks.solving:
            lead_done(ranks)
        raise
    lead_done(ranks)
    ranks.close()


def lost_rank(failures: dict) -> tuple[int, object]:
    """(rank, failure) of the rank that was lost, from the launcher's failures (rank -> ProcessFailure: exitcode,
    negative for a signal, and a timestamp). The launcher ends the survivors with SIGTERM once one rank is gone, and
    its timestamps are whole seconds: a rank that died of another signal is the one lost, whatever the clock says;
    then the earliest, then the lowest rank."""
    signalled = {r: f for r, f in failures.items() if f.exitcode < 0}
    dead = {r: f for r, f in signalled.items() if f.exitcode != -signal.SIGTERM} or signalled or failures
    return min(dead.items(), key=lambda kv: (kv[1].timestamp, kv[0]))


def launch_local(count: int, argv: list[str]) -> int:
    """`quant quantize ... --ranks N`: run the same command (`argv`, --ranks taken out) as N ranks on this machine
    under torch's elastic launcher (what torchrun runs: a rendezvous on a free local port, one process per rank,
    every rank stopped when one fails). Returns the exit code. The launcher's own failure report is silenced: a
    rank that failed with an exit code said why in its line; ranks that died of a signal (none said anything) are
    named here in one line (`RankLost`)."""

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if count < 1:
        raise QuantError(f"--ranks {count}: must be at least 1")
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL + 1)
    logging.getLogger("torch.distributed.launcher").setLevel(logging.CRITICAL + 1)
    args = []
    skip = False
    for a in argv[1:]:
        if skip:
            skip = False
        elif a == "--ranks":
            skip = True
        elif not a.startswith("--ranks="):
            args.append(a)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=count, run_id=f"quant-{uuid.uuid4().hex[:12]}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1)
    os.environ[LOCAL_LAUNCHER_ENV] = "1"  # the ranks leave naming a lost one to this launcher
    try:
        elastic_launch(config, sys.executable)("-m", "quant", *args)
    except ChildFailedError as e:
        codes = {rank: failure.exitcode for rank, failure in e.failures.items()}
        if codes.get(0, 0) > 0:  # rank 0 said why (a lost peer included)
            return codes[0]
        # Another rank's own failure (it named itself); 75 is a rank that only lost a peer, silently.
        said = [codes[r] for r in sorted(codes) if codes[r] > 0 and codes[r] != RankLost.exit_code]
        if said:
            return said[0]
        rank, failure = lost_rank(e.failures)
        how = failure.signal_name() if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        raise RankLost(f"GPTQ rank {rank} of {count} died ({how}); the layers solved so far are kept in "
                       f"OUT/.quant-gptq/: run the same command again to resume") from None
    return 0
