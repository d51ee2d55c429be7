"""GPTQ's layer loop (`LayerLoop`): the main decoder layers one at a time, then the MTP draft layers, each loaded,
solved (`layer.solve_layer`) or its earlier solution resumed from the store (`persist`), replaced by its quantized
weights and run forward to give the next layer its inputs.

The MTP / NextN draft layers (beyond num_hidden_layers; transformers never runs them) are solved after the main
layers, with the same solver and settings: each is built and fed as the engines run it (`quant.gptq.mtp`,
`quant.model_exec.mtp`: the final-norm hidden state of the quantized main layers at t and the embedding of token
t+1, through the draft's BF16 glue), and its records and solved weights go to `mtp-NNNNN.*` beside the layers'."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from quant.gptq.layer import LayerContext, solve_layer
from quant.gptq.persist import chained, previous_solution, save_layer_solution
from quant.gptq.progress import Phase, Progress, layer_line
from quant.gptq.schedule import job_work
from quant.model_exec.mtp import MtpBlock
from quant.planning.plan import TensorJob
from quant.planning.schemes import SCHEMES


@dataclass
class LayerLoop:
    """The run's walk over its layers; `key` is the content key of what the next layer's solution is made from
    (`persist.chained`), starting at the run's (`persist.run_key`)."""

    stack: object              # quant.model_exec.layers.DecoderStack
    context: LayerContext
    store: Path | None         # OUT/.quant-gptq/ (rank 0; None on the other ranks)
    key: str
    write: object
    progress: Progress
    log: object
    started: float             # when calibration began (perf_counter)
    first: bool = True         # no layer solved yet (the first one solved says when it starts)

    @property
    def timing(self) -> Counter:
        return self.context.timing

    @property
    def ranks(self):
        return self.context.ranks

    def run(self, index: int, jobs: list[TensorJob], hidden: list, carry: list[dict]) -> tuple[list, list[dict]]:
        """Main decoder layer `index` over the calibration activations `hidden` (and what earlier layers carry
        beside them); returns the next layer's."""
        stack, timing = self.stack, self.timing
        t0 = time.perf_counter()
        layer = stack.load_layer(index)
        self.key = chained(self.key, stack.identity[index])
        timing["gptq_load_s"] += time.perf_counter() - t0

        def slot_of(job):
            return stack.slot(index, job.source.name, job.source.expert, job.source.rows)

        solved, resumed = self._solution(index, index, None, layer, jobs, slot_of,
                                         partial(stack.run_layer, index, layer, hidden, carry))
        with Phase(timing, "gptq_apply_s", self.ranks):
            _apply_quantized(layer, jobs, solved, self.context.scale_mode, slot_of)
        with Phase(timing, "gptq_forward_s", self.ranks):
            hidden, carry = stack.forward(index, layer, hidden, carry)
        stack.release_layer(index)
        del layer
        self._done(index, f"layer {index + 1}/{len(stack)}", solved, jobs, resumed, t0)
        return hidden, carry

    def _solution(self, stored: int | str, index: int, name: str | None, layer, jobs: list[TensorJob], slot_of,
                  run_pass) -> tuple[dict, bool]:
        """(the layer's solution, resumed): an earlier run's made from the same content, from the store (`stored`:
        its name there), else solved now and saved there. `index` numbers the layer for the progress lines (main
        layers, then the MTP layers after them), `name` names it (default: "layer I/N")."""
        previous = previous_solution(self.store, stored, self.key, self.ranks)
        if previous is not None:
            return previous, True
        if self.first and name is None:
            self.log(f"gptq: layer {index + 1}/{len(self.stack)}: starting ({len(jobs)} weights; calibration "
                     f"inputs ready after {time.perf_counter() - self.started:.1f} s)")
            self.first = False
        self.progress.begin_layer(index, jobs, {j.output: job_work(self.stack.ckpt, j) for j in jobs}, name=name)
        solved = solve_layer(layer, jobs, slot_of, run_pass, self.context)
        t1 = time.perf_counter()
        if self.store is not None:
            save_layer_solution(self.store, stored, solved, self.key, self.write)
        self.timing["gptq_save_s"] += time.perf_counter() - t1
        return solved, False

    def _done(self, index: int, name: str, solved: dict, jobs: list[TensorJob], resumed: bool, t0: float) -> None:
        elapsed = time.perf_counter() - t0
        eta = "" if resumed else self.progress.end_layer(index, elapsed)
        self.log(layer_line(name, solved, len(jobs), resumed, elapsed, eta))

    def run_mtp(self, mtp: list, mtp_jobs: dict, tokens, hidden: list, batch: int) -> None:
        """The MTP draft layers `mtp` (`quant.gptq.mtp.MtpLayerRef`, in order) after the main layers: `hidden` are
        the last main layer's outputs per calibration batch (of `tokens` [N, L], `batch` windows each). Draft layer
        k at position t sees the final-norm hidden state at t (layer k > 0: draft layer k-1's output at t) and the
        embedding of token t+k+1, as the engines run it (`quant.model_exec.mtp`); its quantized weights are then
        replaced by their solved values before the next draft layer is fed its output. On several ranks, `tokens`
        and `hidden` are this rank's share of the batches."""
        t0 = time.perf_counter()
        norm = self.stack.text.norm
        prev = [norm(h) for h in hidden]
        batches = [tokens[b:b + batch] for b in range(0, tokens.shape[0], batch)]
        self.timing["gptq_forward_s"] += time.perf_counter() - t0
        for ref in mtp:
            prev = self._mtp_layer(ref, mtp_jobs[ref.k], batches, prev, last=ref is mtp[-1])

    def _mtp_layer(self, ref, jobs: list[TensorJob], batches: list, prev: list, last: bool) -> list:
        """One draft layer, fed `prev` (emptied once its inputs are made); returns its outputs (none for the last)."""
        import torch


        stack, timing = self.stack, self.timing
        t0 = time.perf_counter()
        with stack.reader.hashing() as read:
            block = MtpBlock(stack, ref.names)
        self.key = chained(self.key, read())
        timing["gptq_load_s"] += time.perf_counter() - t0
        t1 = time.perf_counter()
        inputs = [block.inputs(tok[:, ref.k + 1:], h[:, :-1]) for tok, h in zip(batches, prev)]
        prev.clear()
        timing["gptq_forward_s"] += time.perf_counter() - t1

        slot_of = partial(_block_slot, block)
        name = f"MTP layer {ref.block.rstrip('.')}"
        solved, resumed = self._solution(f"mtp-{ref.k:05d}", len(stack) + ref.k, name, block.layer, jobs, slot_of,
                                         partial(_outputs, block, inputs))
        with Phase(timing, "gptq_apply_s", self.ranks):
            _apply_quantized(block.layer, jobs, solved, self.context.scale_mode, slot_of)
        with Phase(timing, "gptq_forward_s", self.ranks), torch.no_grad():
            out = [block.run(z, positions) for z, positions in inputs] if not last else []
        del inputs, block, slot_of  # the MTP layer's weights and inputs freed before the next one
        self._done(len(stack) + ref.k, name, solved, jobs, resumed, t0)
        return out


def _block_slot(block, job):
    """Where the MTP block holds `job`'s weight."""
    return block.slot(job.source.name, job.source.expert, job.source.rows)


def _outputs(block, inputs):
    """The MTP block's outputs for each calibration batch, computed as the solve consumes them."""
    return (block.run(z, positions) for z, positions in inputs)


def _apply_quantized(layer, jobs: list[TensorJob], solved: dict, scale_mode: str, slot_of) -> None:
    """Replace every quantized weight of the layer by the values the engines will compute with (GPTQ's, or the
    scheme's round-to-nearest), so the next layer calibrates on the quantized model's activations."""
    import torch


    params = dict(layer.named_parameters())
    for job in jobs:
        slot = slot_of(job)
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
