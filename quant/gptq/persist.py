"""The store of solved layers (OUT/.quant-gptq/): one safetensors file of packed codes and scale bytes per layer
(`layer-NNNNN`, the MTP layers' `mtp-NNNNN`) with a JSON record beside it, written last, that marks it solved; the
content keys that say whether a stored solution is still the one a resumed run would make (`run_key`, `chained`,
`layer_digest`); and `SolvedWeights`, what the shard writer reads them back through."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from quant.gptq.schedule import layer_of
from quant.planning.plan import TensorJob


class SolvedWeights:
    """The solved weights in the run's store (OUT/.quant-gptq/), a `quant.pipeline.solver.Solution`: `parts(job)`
    gives {suffix: tensor} and the record of a weight GPTQ solved, or None (round it to nearest). `timing`: seconds
    per phase of the run that solved them (`progress.PHASES`)."""

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


# -- content keys -----------------------------------------------------------------------------------------------
def run_key(digest: str, tokens, stack) -> str:
    """The start of the chain: the plan digest, the calibration tokens' bytes and what the text model's own
    weights (embedding, final norm) read."""
    h = hashlib.sha256(f"{digest}:{stack.identity['text']}:{list(tokens.shape)}:".encode())
    h.update(tokens.contiguous().view(-1).cpu().numpy().tobytes())
    return h.hexdigest()


def chained(key: str, read: str) -> str:
    """The content key of the next layer's solution: the key of everything before it (settings, calibration
    tokens, the text model's own weights and every earlier layer) and the sha256 of the bytes its load read. A
    layer's inputs are made by every layer before it, so an edit anywhere upstream makes every later solution
    stale."""
    return hashlib.sha256(f"{key}:{read}".encode()).hexdigest()


def layer_digest(key: str, index: int | str) -> str:
    """What layer `index`'s record holds as its digest, from its content key (`chained`)."""
    return hashlib.sha256(f"{key}:{index}".encode()).hexdigest()


# -- the layer files --------------------------------------------------------------------------------------------
def _layer_file(store: Path, index: int | str, suffix: str) -> Path:
    """A main layer's file (`index` its number) or an MTP layer's (`index` "mtp-K")."""
    return store / (f"{index}{suffix}" if isinstance(index, str) else f"layer-{index:05d}{suffix}")


def save_layer_solution(store: Path, index: int | str, solved: dict, key: str, write) -> None:
    """Layer `index`'s solution ({"records", "parts"}) into the store under its content key, by `write(path,
    text, tmp_dir)` (the pipeline's atomic write) for the record."""
    from safetensors.torch import save_file

    tensors = {f"{out}.{s}": t for out, p in solved["parts"].items() for s, t in p.items()}
    weights = _layer_file(store, index, ".safetensors")
    tmp = weights.with_suffix(".safetensors.partial")
    save_file(tensors, str(tmp))
    tmp.replace(weights)
    # The record last: it is what marks the layer solved.
    write(_layer_file(store, index, ".json"),
          json.dumps({"digest": layer_digest(key, index), "weights": solved["records"]}, sort_keys=True), store)


def _load_layer_solution(store: Path, index: int | str, record: dict) -> dict:
    from safetensors import safe_open

    parts: dict[str, dict] = {}
    with safe_open(str(_layer_file(store, index, ".safetensors")), framework="pt") as f:
        for out, rec in record["weights"].items():
            if rec["method"] == "gptq":
                parts[out] = {s: f.get_tensor(f"{out}.{s}") for s in ("weight", "weight_scale")}
    return {"records": record["weights"], "parts": parts}


def previous_solution(store: Path | None, index: int | str, key: str, ranks=None) -> dict | None:
    """An earlier run's solution of layer `index` made from the same content (`key`), from the store (rank 0 reads
    it; on several ranks it is broadcast to the others, which have no store), or None."""
    solution = None
    if store is not None:
        record_path = _layer_file(store, index, ".json")
        previous = json.loads(record_path.read_text()) if record_path.is_file() else None
        if previous and previous.get("digest") == layer_digest(key, index):
            solution = _load_layer_solution(store, index, previous)
    if ranks is not None and ranks.size > 1:
        solution = ranks.broadcast(solution, 0, "resuming the finished layers")
    return solution
