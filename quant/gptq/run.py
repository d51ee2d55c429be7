"""GPTQ over a whole checkpoint, one decoder layer at a time (`quant quantize --method gptq`): `solve_checkpoint`,
from the calibration tokens to the solved weights the shard writer reads.

Data flow: the calibration windows run through transformers' own model (built from config.json on the meta
device: `quant.model_exec.layers.DecoderStack`) up to the first decoder layer; then, for each decoder layer in
turn (`loop.LayerLoop`), only that layer's weights are read from the source shards, the input Hessians of its
MXFP4 weights are accumulated over the calibration activations, each weight is solved (`layer.solve_layer`,
`solve.gptq_mxfp4`), every quantized weight of the layer is replaced by what the engines will compute with, and
the activations go through the quantized layer to become the next layer's inputs. Peak memory is one layer, its
Hessians and two copies of the calibration activations. The MTP / NextN draft layers are solved after the main
layers, fed as the engines run them (`loop.LayerLoop.run_mtp`).

The solved weights (packed codes and scale bytes, exactly what the export stores) go to the store the pipeline
gives (`OUT/.quant-gptq/`, `persist`), one safetensors file per layer with a JSON record beside it; the shard
writer (`pipeline.execute`) takes them from there (`persist.SolvedWeights`) instead of rounding to nearest. The
pipeline knows GPTQ only as the `quant.pipeline.solver.WeightSolver` the command hands it
(`settings.GptqSettings`). A killed run resumes at the first layer without a record (earlier layers are re-run
forward with their solved weights, not re-solved).

On several torch.distributed ranks (`quant.gptq.ranks`: torchrun, or `quant quantize --ranks N`), each rank runs
its share of the calibration batches through every layer and solves the weights it owns, fed their inputs batch by
batch in the global order (`layer`); the bytes are one process's.

The modules: `settings` (GptqSettings), `run` (this), `loop` (the layer loop), `layer` (one layer's solve),
`schedule` (jobs, passes, solve units, costs, workers), `persist` (the store and its content keys), `progress`
(progress lines, ETAs, phase timing), `hessians`, `solve` (the GPTQ algorithm), `calibration`, `mtp`, `ranks`,
`dry_run`.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from quant.gptq.calibration import calibration_tokens
from quant.gptq.layer import LayerContext
from quant.gptq.loop import LayerLoop
from quant.gptq.mtp import mtp_layers
from quant.gptq.persist import SolvedWeights, run_key
from quant.gptq.progress import PHASES, Progress, calibration_line, report_run
from quant.gptq.ranks import Ranks
from quant.gptq.schedule import Workers, quantized_jobs_by_layer, split_mtp_jobs, work
from quant.model_exec.layers import DecoderStack, meta_model
from quant.planning.plan import Plan

# What other packages import from here (the command, the benchmarks): the run, its result and phases. The settings
# live in quant.gptq.settings, which calls this module (its `solve`): importing them here would close a circle.
__all__ = ["PHASES", "SolvedWeights", "solve_checkpoint"]


def solve_checkpoint(plan: Plan, ckpt, src_path: Path, store: Path | None, devices: str | list[str],
                     settings, layer_returns: list[str], digest: str, write, log=print,
                     ranks=None) -> SolvedWeights | None:
    """Solve every MXFP4 weight of the decoder layers with GPTQ into `store` (OUT/.quant-gptq/; resuming what an
    earlier run of the same plan solved there), each layer's record written by `write(path, text, tmp_dir)` (the
    pipeline's atomic write). `log` gets a line before calibration, one when the first layer begins, progress
    within each layer (weights and experts solved, ETAs; at most one line every progress.PROGRESS_SECONDS) and one
    per finished layer.

    `devices` (one device string or the run's device list): the calibration forward passes and the Hessians run
    on the first; each layer's solves (independent groups of experts, and plain linears) are shared among all of
    them by `schedule.Workers`, the result byte-identical to one worker's (see there). A family whose decoder
    layer transformers cannot build from the checkpoint is refused (QuantError) before calibration starts.

    `ranks` (a `quant.gptq.ranks.Ranks` of size > 1): this process is one of several, each on its own device
    (`devices`: that one), running its share of the calibration batches and solving the weights it owns (see
    `quant.gptq.ranks`); the bytes are one process's. Only rank 0 has a `store` (and `write`) and returns the
    SolvedWeights; the others return None."""
    import torch


    devices = [devices] if isinstance(devices, str) else list(devices)
    ranks = ranks if ranks is not None else Ranks(device=devices[0])
    if ranks.threads is not None:
        from quant.process import set_threads

        set_threads(ranks.threads)  # every CPU rank at the same thread count, rank 0 too
    dtype = torch.float32 if torch.device(devices[0]).type == "cpu" else torch.bfloat16
    model = meta_model(src_path, ckpt, dtype)  # before any work: a family GPTQ cannot run is one line
    if store is not None:
        store.mkdir(exist_ok=True)
    log(calibration_line(settings.calibration, devices, ranks.size))
    started = time.perf_counter()
    tokens = calibration_tokens(settings.calibration, src_path) if ranks.rank == 0 else None
    tokens = ranks.broadcast(tokens, 0, "sending the calibration tokens")
    comm0, comm_cpu0 = ranks.comm_s, ranks.comm_cpu_s  # waiting for the others is set-up, not communication
    # The batches as one process cuts them; this rank runs a contiguous share of them (all, with one rank).
    mine = ranks.share(-(-tokens.shape[0] // settings.batch))
    local = tokens[mine.start * settings.batch:mine.stop * settings.batch]
    stack = DecoderStack(src_path, ckpt, layer_returns, devices[0], dtype, model)
    by_layer, mtp, mtp_jobs = split_mtp_jobs(quantized_jobs_by_layer(plan), mtp_layers(ckpt))
    workers, timing = Workers(devices), Counter()
    progress = _progress(log, ckpt, stack, by_layer, mtp, mtp_jobs)
    loop = LayerLoop(stack, LayerContext(settings, plan.scale_mode, workers, timing, ranks, progress.solved), store,
                     run_key(digest, tokens, stack), write, progress, log, started)
    with torch.no_grad(), workers:
        hidden = stack.capture(local, settings.batch) if local.shape[0] else []
        carry: list[dict] = [{} for _ in hidden]
        timing["gptq_calibration_s"] += time.perf_counter() - started - (ranks.comm_s - comm0)
        for index in range(len(stack)):
            hidden, carry = loop.run(index, by_layer.get(index, []), hidden, carry)
        if mtp:
            loop.run_mtp(mtp, mtp_jobs, local, hidden, settings.batch)
    timing["gptq_comm_s"] = ranks.comm_s - comm0
    report_run(log, ranks, timing, len(stack), len(mtp), tokens.shape, time.perf_counter() - started,
               ranks.comm_cpu_s - comm_cpu0)
    ranks.solving = False
    if store is None:
        return None
    return SolvedWeights(store, len(stack), {k: timing[k] for k in PHASES})


def _progress(log, ckpt, stack, by_layer: dict, mtp: list, mtp_jobs: dict) -> Progress:
    """The run's progress lines, its work by layer: the main layers', then the MTP layers' after them."""
    layers = {i: work(ckpt, by_layer.get(i, [])) for i in range(len(stack))}
    layers.update({len(stack) + ref.k: work(ckpt, mtp_jobs[ref.k]) for ref in mtp})
    return Progress(log, layers, len(stack))
