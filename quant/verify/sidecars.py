"""Sidecars the config declares (the family's `sidecars`, quant/families/sidecars.py: DeepSeek-V4.1's Engram
tables, a separate draft file): an export without one, or with one in another dtype or shape than the engine
allocates, is an error naming the sidecar, the config key declaring it and the tensor or file. Headers only.

A missing Engram table is not caught at load by every engine (hipfire#743: should be declared, never silently
missing); vLLM's loader would fail on a shape mismatch only deep in ParallelEngramEmbedding's weight loader."""

from __future__ import annotations

from quant.checkpoint import INDEX_FILE, Checkpoint
from quant.errors import QuantError
from quant.families import family_for_config, text_config
from quant.families.sidecars import Expected, expected_sidecars
from quant.verify.report import Finding

__all__ = ["sidecar_findings"]

RULE = "#43 sidecar"


def _tensor_findings(exp: Expected, ckpt: Checkpoint) -> list[Finding]:
    side, out = exp.sidecar, []
    for name, (dtype, shape) in exp.tensors.items():
        info = ckpt.tensors.get(name)
        if info is None:
            out.append(Finding("error", "all", (), name,
                               f"config.json declares the {side.name} sidecar ({side.declared_by}) but the export "
                               f"has no tensor {name}: the engine builds it and has nothing to load",
                               "carry the table over from the source as stored (quant quantize does), or drop "
                               f"{side.declared_by} from config.json", RULE))
        elif info.dtype != dtype or (shape is not None and tuple(info.shape) != shape):
            want = f"{dtype} {list(shape) if shape else '[?]'}"
            out.append(Finding("error", "all", (), name,
                               f"{side.name} sidecar ({side.declared_by}): {name} is {info.dtype} "
                               f"{list(info.shape)} but the engine allocates {want} ({side.source})",
                               "carry the table over from the source bytes unchanged", RULE))
    return out


def _file_finding(exp: Expected, ckpt: Checkpoint) -> list[Finding]:
    side = exp.sidecar
    if ckpt.has_file(exp.file):
        if ckpt.index is None or exp.file in ckpt.files:
            return []
        # SGLang reads only the files an index names (model_loader/weight_utils.py filter_duplicate_safetensors_files,
        # :807 in 0.5.23): a draft file the index leaves out is never loaded
        return [Finding("error", "all", (), exp.file,
                        f"config.json declares the {side.name} sidecar ({side.declared_by}) and the export has "
                        f"{exp.file}, but {INDEX_FILE} lists none of its tensors: an engine that finds an index reads "
                        "only the files it names, so the draft is never loaded",
                        f"add {exp.file}'s tensors to {INDEX_FILE}'s weight_map (quant quantize does)", RULE)]
    return [Finding("error", "all", (), exp.file,
                    f"config.json declares the {side.name} sidecar ({side.declared_by}) but the export has no file "
                    f"{exp.file}", f"copy {exp.file} from the source byte for byte", RULE)]


def sidecar_findings(ckpt: Checkpoint) -> list[Finding]:
    """One error per declared sidecar tensor or file the export lacks or stores otherwise than the engine builds."""
    try:
        family = family_for_config(ckpt.config)
    except QuantError:
        return []  # no model_type: the config checks name that
    out: list[Finding] = []
    for exp in expected_sidecars(family.sidecars, text_config(ckpt.config)):
        out += _file_finding(exp, ckpt) if exp.file else _tensor_findings(exp, ckpt)
    return out
