"""What `quant quantize` would write for a plan, as headers and config.json only: an in-memory Checkpoint that
`verify_checkpoint` reads as it reads an export (the tensors' names, dtypes and shapes, the quantization_config),
with no weight read or written. `quant search` previews each pick's export with it before it returns the pick.
"""

from __future__ import annotations

from quant.checkpoint import Checkpoint, TensorInfo
from quant.errors import QuantError
from quant.pipeline.run import quantization_config
from quant.planning.plan import Plan
from quant.planning.schemes import get_scheme
from quant.planning.written import written_tensors


def preview_checkpoint(plan: Plan, source: Checkpoint) -> Checkpoint:
    """The export of `plan` from `source` as its headers and config.json would read (a BF16 source: copies and
    round-to-nearest or GPTQ quantization; both write the same tensors)."""
    tensors: dict[str, TensorInfo] = {}
    for shard in plan.shards:
        for job in shard.jobs:
            info = source.tensors[job.source.name]
            shape = tuple(info.shape[1:]) if job.source.expert is not None else tuple(info.shape)
            if job.source.rows is not None:
                shape = (job.source.rows[1] - job.source.rows[0], *shape[1:])
            if job.action == "copy":
                tensors[job.output] = TensorInfo(job.output, shard.file, info.dtype, shape)
            elif job.action == "quantize" and job.scheme is not None:
                for suffix, dtype, _, _, trailing in written_tensors(get_scheme(job.scheme), int(shape[-1])):
                    name = f"{job.output}.{suffix}"
                    tensors[name] = TensorInfo(name, shard.file, dtype, (int(shape[0]), *trailing))
            else:
                raise QuantError(f"{source.root}: {job.output} would be {job.action}d; a preview reads BF16 sources")
    config = {k: v for k, v in source.config.items() if k != "quantization_config"}
    config["quantization_config"] = quantization_config(plan, source.config)
    return Checkpoint(source.root, config, tensors, sorted({s.file for s in plan.shards}), None)
