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

__all__ = ["sidecar_findings", "content_findings", "source_draft_problems"]

RULE = "sidecar"


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


def content_findings(exp: Expected, ckpt: Checkpoint) -> list[Finding]:
    """The sidecar file's tensors against what the engine's class for it allocates (`Expected.contents`): one
    error per tensor missing, of another dtype or shape, or with no parameter to load into. Its header only."""
    side = exp.sidecar
    if not exp.contents:
        return []
    try:
        stored = ckpt.file_header(exp.file)
    except (OSError, ValueError) as e:
        return [Finding("error", "all", (), exp.file, f"{ckpt.shard_path(exp.file)}: cannot read its header ({e})",
                        f"copy {exp.file} from the source byte for byte", RULE)]
    out = []
    for name, want in exp.contents.items():
        if name not in stored:
            if want.required:
                out.append(Finding("error", "all", (), name,
                                   f"{exp.file} has no {name}, which the {side.name} draft class allocates and its "
                                   f"loader requires (it raises on a missing tensor: {side.source})",
                                   f"restore {name} in {exp.file} from the release", RULE))
            continue
        dtype, shape = stored[name]
        if dtype not in want.dtypes or (want.shape is not None and tuple(shape) != want.shape):
            out.append(Finding("error", "all", (), name,
                               f"{exp.file}: {name} is {dtype} {list(shape)} but the {side.name} draft class "
                               f"allocates {'/'.join(want.dtypes)} {list(want.shape) if want.shape else '[?]'} "
                               f"({side.source})", f"restore {name} in {exp.file} from the release", RULE))
    for name in sorted(n for n in stored if exp.unexpected(n)):
        out.append(Finding("error", "all", (), name,
                           f"{exp.file} holds {name}, for which the {side.name} draft class has no parameter (its "
                           f"loader raises on an unexpected tensor: {side.source})",
                           f"remove {name} from {exp.file}, or check the draft matches config.json", RULE))
    return out


def _file_finding(exp: Expected, ckpt: Checkpoint) -> list[Finding]:
    side = exp.sidecar
    if ckpt.has_file(exp.file):
        contents = content_findings(exp, ckpt)
        if ckpt.index is None or exp.file in ckpt.files:
            return contents
        # SGLang reads only the files an index names (model_loader/weight_utils.py filter_duplicate_safetensors_files,
        # :807 in 0.5.23): a draft file the index leaves out is never loaded
        return [Finding("error", "all", (), exp.file,
                        f"config.json declares the {side.name} sidecar ({side.declared_by}) and the export has "
                        f"{exp.file}, but {INDEX_FILE} lists none of its tensors: an engine that finds an index reads "
                        "only the files it names, so the draft is never loaded",
                        f"add {exp.file}'s tensors to {INDEX_FILE}'s weight_map (quant quantize does)",
                        RULE)] + contents
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


def source_draft_problems(ckpt: Checkpoint) -> list[Finding]:
    """What a source's declared sidecar files hold that the engine's class for them cannot load (quantize refuses
    the first before OUT exists: the export would carry it byte for byte)."""
    try:
        family = family_for_config(ckpt.config)
    except QuantError:
        return []
    return [f for exp in expected_sidecars(family.sidecars, text_config(ckpt.config))
            if exp.file and ckpt.has_file(exp.file) for f in content_findings(exp, ckpt)]
