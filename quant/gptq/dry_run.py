"""`quant quantize --dry-run`: what a run would hold in memory, per device, predicted from config.json alone.

Nothing is read but config.json (no weights, no tokenizer, no calibration text) and nothing is written: OUT is
neither created nor looked at. The decoder layers are the ones `--method gptq` runs: transformers builds the
model from config.json on the meta device (`quant.model_exec.layers.config_model`, no memory), so every
parameter's shape, which weights are `nn.Linear`s and which are fused `[E, ...]` expert parameters come from the
same code the run uses. Which of them are quantized comes from the family's roles and the recipe (as the planner
decides), the per-token sizes of what a layer carries to the next one and of its forward's largest transient from
the family file (`decoder_layer.carry_bytes_per_token`, `workspace_bytes_per_token`).

The memory model (`memory_model`, a `MemoryModel`; `render` writes the report, `predict` does both) follows
`quant.gptq.run.solve_checkpoint` layer by layer, its calibration passes and solve groups cut by the run's own
`schedule.layer_schedule` (`schedule.hessian_passes`, `schedule.solve_groups`). On the first device (calibration,
Hessians, and its share of the solves):
  - resident: the text model outside the layers (embedding, final norm) and the layer kwargs (causal mask);
  - the calibration activations: samples x seq_len x hidden in the compute dtype (bf16 on CUDA, fp32 on CPU),
    plus each carried return (GLM-5's top-k indices); twice while a layer's forward builds the next inputs;
  - the layer being solved, in the compute dtype; while it loads, one fused expert parameter twice (stacked
    from per-expert tensors, then copied in);
  - one calibration pass's fp32 Hessians (in_features^2 x 4 bytes per linear and per expert): the experts of a
    fused parameter are split into passes of at most `hessian_bytes` (`--hessian-budget`), the plain linears
    ride along with the first pass; each pass runs the layer's forward over every calibration window again;
  - the solver's working set for one group of experts (`schedule.solve_groups`): float64 H, its Cholesky factor, the
    inverse and the inverse's factor, beside the fp32 H and weights (`solve.gptq_mxfp4`).
Every other device only solves groups: one group's working set. The host holds the calibration tokens, the
solved codes and scales of two layers (the finished layer's until the next one is solved, and the layer written
to OUT/.quant-gptq/ with its serialised copy), and up to `SourceReader.REMAP_BYTES` of mapped source pages; with
CPU devices everything above is host memory, each CPU worker adding its own group.

Not predicted: the process's fixed cost (torch, transformers, CUDA contexts, compiled kernels: about 0.5 GB of
host memory on CPU) and the shard-writing phase after GPTQ (one source shard per worker, whose size
config.json does not say).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from quant.checkpoint import SourceReader
from quant.errors import QuantError
from quant.families import family_for_config, mtp_layout, text_config
from quant.families.shapes import evaluate
from quant.gptq.schedule import expert_modules, layer_schedule
from quant.gptq.settings import GptqSettings
from quant.model_exec.layers import LayerNames, config_model
from quant.model_exec.mtp import draft_config
from quant.planning.recipes import load_recipe
from quant.planning.schemes import DEFAULT_SCHEME, MXFP4_SCHEMES, get_scheme
from quant.planning.treatment import ModuleTreatment
from quant.units import GIB, human, parse_size  # noqa: F401  (parse_size: the command's flags)

HEADROOM = 0.9  # the share of a device the suggested --hessian-budget may fill; the rest is the runtime's (CUDA
# context, cuBLAS workspaces, the caching allocator's fragmentation), which the prediction does not count


@dataclass
class LayerPlan:
    index: int
    weights: int  # weights GPTQ solves in this layer
    passes: int  # calibration passes (forwards over every window) of this layer
    experts_per_pass: int | None
    layer_bytes: int
    load_extra: int  # a fused expert parameter stacked before it is copied in
    hessian_bytes: int  # the largest pass's Hessians
    hessians_total: int  # every Hessian of the layer, were they held at once
    solve_bytes: int  # the largest group's working set
    parts_bytes: int  # the solved codes and scales kept on the host
    groups: int
    gather_bytes: int = 0  # one group's weights, gathered on the first device for a solve on another
    plain_hessians: int = 0  # the plain linears' Hessians (in the first pass)
    per_expert: int = 0  # one expert's Hessians, of the layer's largest fused expert module
    experts: int = 0  # experts of that module
    input_width: int = 0  # elements per token of the inputs its solved weights are fed (on several ranks, kept)


@dataclass
class Prediction:
    lines: list[str] = field(default_factory=list)
    peaks: dict[str, int] = field(default_factory=dict)  # "device:<d>" / "host" -> bytes
    passes: dict[int, int] = field(default_factory=dict)  # layer -> calibration passes
    mtp_passes: dict[int, int] = field(default_factory=dict)  # MTP layer solved after them -> calibration passes
    rank_sweeps: dict[int, int] = field(default_factory=dict)  # on several ranks: layer -> Hessian sweeps per rank

    def text(self) -> str:
        return "\n".join(self.lines)


def config_dir(src: str) -> tuple[Path, dict]:
    path = Path(src)
    if path.is_dir():
        config_path = path / "config.json"
        if not config_path.is_file():
            raise QuantError(f"{path}: no config.json")
    else:
        from quant.hub import hub_reference

        ref = hub_reference(src)
        if ref is None:
            raise QuantError(f"{src}: not a directory with a config.json, nor a Hub repository ORG/NAME[@REVISION]")
        if os.environ.get("HF_HUB_OFFLINE") in ("1", "true", "True"):
            raise QuantError(f"{src}: not a local directory, and the Hugging Face hub is offline")
        from huggingface_hub import hf_hub_download

        try:
            config_path = Path(hf_hub_download(ref.repo_id, "config.json", revision=ref.revision))
        except Exception as e:
            raise QuantError(f"{src}: cannot fetch config.json ({str(e).splitlines()[0][:160]})") from None
        path = config_path.parent
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise QuantError(f"{config_path}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise QuantError(f"{config_path}: expected a JSON object")
    return path, config


def _device_list(devices: str, workers: int) -> list[str]:
    """--devices as a dry run reads it: named devices need not be present (sizing 8 GPUs from a laptop)."""
    import torch

    if devices in (None, "auto"):
        from quant.process import auto_devices, visible_accelerators

        return auto_devices(workers, visible_accelerators())
    items = [d.strip() for d in devices.split(",") if d.strip()]
    for d in items:
        try:
            torch.device(d)
        except RuntimeError:
            raise QuantError(f"--devices: {d!r} is not a torch device") from None
    if not items:
        raise QuantError("--devices: no device named")
    return items


def _capacity(device: str, device_memory: int | None) -> int | None:
    import torch

    dev = torch.device(device)
    if dev.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
    if device_memory:
        return device_memory
    if dev.type == "cuda" and torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count():
        return torch.cuda.get_device_properties(dev.index or 0).total_memory
    return None


def family_expression(expr, values: dict, what: str) -> int:
    result = evaluate(expr, {**values, "min": min, "max": max})
    if result is None:
        raise QuantError(f"family data {what} = {expr!r}: cannot be evaluated for this config.json "
                         f"(a key it names is missing)")
    return result


def solver_bytes(group: int, rows: int, k: int) -> int:
    """Peak bytes of `_solve_group` for `group` matrices [rows, k]: while `damped_inverse_factor` factors the
    inverse, fp32 H (4) + float64 H (8) + Cholesky factor (8) + inverse (8) + its factor in float64 (8) and fp32
    (4) = 40 k^2 per matrix, beside the fp32 weights; later, fp32 H with about six [rows, k] fp32 tensors
    (weights, their working copy, GPTQ's values, the RTN reference and output_error's products)."""
    return group * max(40 * k * k + 4 * rows * k, 4 * k * k + 24 * rows * k)


def plan_layers(model, family, solved, settings, dtype_bytes: int) -> list[LayerPlan]:
    """Each decoder layer's GPTQ work and memory, from the meta model (shapes only)."""

    prefix = family.text_prefixes[0]
    names = LayerNames.of_family(family)
    return [_plan_layer(index, layer, f"{prefix}layers.{index}.", solved, settings, dtype_bytes, names)
            for index, layer in enumerate(model.get_decoder().layers)]


def solved_rule(treatment):
    """Whether GPTQ solves module `name`: an MXFP4 weight of the plan, as `planning.plan.Planner.treatment`
    (`treatment`, a `planning.treatment.ModuleTreatment`) decides it."""

    def solved(name: str) -> bool:
        scheme = treatment(name)[1]
        return scheme is not None and scheme.name in MXFP4_SCHEMES

    return solved


def _plan_layer(index: int, layer, base_name: str, solved, settings, dtype_bytes: int, names=None) -> LayerPlan:
    """One decoder layer's GPTQ work and memory (`layer` on the meta device, its checkpoint names under
    `base_name`, transformers' names mapped to the checkpoint's by `names`, a `layers.LayerNames`), the passes and
    solve units cut as `layer.solve_layer` cuts them (`schedule.layer_schedule`)."""
    import torch


    names = names or LayerNames()
    modules = dict(layer.named_modules())
    plain, fused = {}, {}  # key -> param; fused: key -> (param, experts solved)
    plain_weights = 0  # checkpoint weights the plain linears hold (a fused linear holds several)
    for key, param in layer.named_parameters():
        path, name = key.rsplit(".", 1) if "." in key else ("", key)
        module = modules.get(path)
        if isinstance(module, torch.nn.Linear) and name == "weight":
            parts = names.fused_parts(key) or [names.checkpoint(key)]
            count = sum(solved(base_name + part[:-len(".weight")]) for part in parts)
            if count:
                plain[key] = param
                plain_weights += count
        elif name in ("gate_up_proj", "down_proj") and hasattr(module, "gate_up_proj") and param.dim() == 3:
            base = base_name + names.checkpoint(f"{path}.")[:-1]
            projs = ("gate_proj", "up_proj") if name == "gate_up_proj" else ("down_proj",)
            experts = [e for e in range(param.shape[0])
                       if any(solved(f"{base}.{e}.{names.leaf(p)}") for p in projs)]
            if experts:
                fused[key] = (param, experts)
    # The passes and solve units the run cuts: the run's own cut (schedule.layer_schedule).
    schedule = layer_schedule(layer, list(plain), {k: experts for k, (_, experts) in fused.items()}, settings)
    passes = schedule.passes
    modules = expert_modules({k: (p.shape[-1], experts) for k, (p, experts) in fused.items()})
    plain_h = sum(p.shape[-1] ** 2 * 4 for p in plain.values())
    pass_h = [sum(plain[k].shape[-1] ** 2 * 4 if k in plain else len(experts) * fused[k][0].shape[-1] ** 2 * 4
                  for k in keys) for keys, experts in passes] or [0]
    groups, solve, gather = len(schedule.units), 0, 0
    for unit in schedule.units:  # the solver's working set, and the weights gathered for a solve elsewhere
        rows, k = layer.get_parameter(unit.key).shape[-2:]
        solve = max(solve, solver_bytes(unit.size(), rows, k))
        gather = max(gather, unit.size() * rows * k * dtype_bytes)
    weights = plain_weights + sum(len(e) * (2 if k.endswith("gate_up_proj") else 1) for k, (_, e) in fused.items())
    elements = sum(p.numel() for p in plain.values()) + sum(len(e) * p[0].numel() for p, e in fused.values())
    layer_bytes = sum(p.numel() for p in layer.parameters()) * dtype_bytes
    layer_bytes += sum(b.numel() * b.element_size() for b in layer.buffers())
    stacked = max([p.numel() * dtype_bytes for p, _ in fused.values()] or [0])
    per_expert = max((m[2] for m in modules), default=0)
    # What a rank records of its batches for the owners (hessians.InputRecorder): each plain linear's input, and
    # each fused experts module's hidden states once (its gate_up and down are both fed from them).
    width = sum(p.shape[-1] for p in plain.values()) + sum(
        layer.get_parameter(f"{k.rsplit('.', 1)[0]}.gate_up_proj").shape[-1] for k in
        {f"{key.rsplit('.', 1)[0]}.gate_up_proj" for key in fused})
    return LayerPlan(
        index=index, weights=weights, passes=len(passes),
        experts_per_pass=max((len(e) for _, e in passes if e is not None), default=None), layer_bytes=layer_bytes,
        load_extra=stacked, hessian_bytes=max(pass_h),
        hessians_total=plain_h + sum(len(e) * p.shape[-1] ** 2 * 4 for p, e in fused.values()),
        solve_bytes=solve, parts_bytes=elements // 2 + elements // 32, groups=groups, gather_bytes=gather,
        plain_hessians=plain_h,
        per_expert=per_expert, experts=max((len(m[1]) for m in modules if m[2] == per_expert), default=0),
        input_width=width)


@dataclass
class MtpPlan:
    """One MTP draft layer GPTQ solves (`quant.gptq.mtp`, `loop.LayerLoop.run_mtp`): its decoder layer's plan
    (index: the layer's number, e.g. 78), what the draft holds beside it and the inputs it is fed."""

    k: int
    block: str  # its checkpoint prefix
    plan: LayerPlan
    glue_bytes: int  # enorm, hnorm, eh_proj [H, 2H] and the draft's final norm, in the compute dtype
    source_bytes: int  # the decoder layer's state read from the source (`model_exec.mtp.block_state`, host)
    stack_extra: int  # one fused expert parameter stacked from per-expert tensors while that state is read
    tokens: int  # calibration tokens it is fed: positions t whose token t+k+1 is in the window


def plan_mtp(root: Path, config: dict, family, mtp, solved, settings, dtype, dtype_bytes: int,
             samples: int, seq_len: int) -> list[MtpPlan]:
    """The MTP draft layers `--method gptq` solves after the main layers (`run.solve_checkpoint`: those of the
    layout `mtp` up to the last one with a weight to solve; none when the recipe keeps the MTP layer BF16 or the
    release publishes no MTP weights), each built as `quant.gptq.mtp.MtpBlock` builds it:
    `quant.model_exec.mtp.draft_config` (the family's `decoder_config`), on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM


    if mtp.draft is None or mtp.draft.unsupported or mtp.unpublished or not mtp.count:  # no draft: RTN
        return []
    prefix = family.text_prefixes[0]
    cfg = draft_config(root, mtp)
    with torch.device("meta"):
        layer = AutoModelForCausalLM.from_config(cfg, dtype=dtype).get_decoder().layers[0]
    hidden = int(cfg.hidden_size)
    source_elt = source_element_bytes(config)
    plans = []
    for k, index in enumerate(mtp.indices):
        block = mtp.block(k, prefix)
        plan = _plan_layer(index, layer, block, solved, settings, dtype_bytes)
        elements = sum(p.numel() for p in layer.parameters())
        fused = max([p.numel() for p in layer.parameters() if p.dim() == 3] or [0])
        plans.append(MtpPlan(k=k, block=block, plan=plan, glue_bytes=(2 * hidden * hidden + 3 * hidden) * dtype_bytes,
                             source_bytes=elements * source_elt, stack_extra=fused * source_elt,
                             tokens=samples * max(0, seq_len - k - 1)))
    while plans and not plans[-1].plan.weights:  # schedule.split_mtp_jobs: up to the last one quantized
        plans.pop()
    return plans


def source_element_bytes(config: dict) -> int:
    """Bytes per element of a source weight as `SourceReader.load` returns it: block-FP8 dequantized to fp32,
    otherwise the checkpoint's dtype (config.json's `dtype` / `torch_dtype`)."""

    quant_cfg = config.get("quantization_config") or text_config(config).get("quantization_config") or {}
    if str(quant_cfg.get("quant_method", "")).lower() == "fp8":
        return 4
    dtype = str(config.get("dtype") or config.get("torch_dtype") or text_config(config).get("dtype") or "bfloat16")
    return 4 if "32" in dtype else 2


@dataclass
class MemoryModel:
    """What a run holds, from config.json alone (the module docstring): the resolved run, and for --method gptq
    every layer's plan and the sizes the phases are made of. `device0`, `host`... compute the peaks; `render`
    writes them out."""

    config_path: Path
    family: str
    decoder_layers: int
    mtp: list[int]  # the MTP layers config.json declares
    scheme: str
    recipe: str
    mtp_layer: str  # the recipe's mtp_layer ("as-main" | "bf16")
    method: str
    devices: list[str]
    # --method gptq only:
    settings: object = None  # the run's GptqSettings
    dtype: str = ""  # the compute dtype ("float32" on CPU, "bfloat16" on accelerators)
    batch: int = 0  # calibration windows per forward
    plans: list[LayerPlan] = field(default_factory=list)
    mtp_plans: list[MtpPlan] = field(default_factory=list)
    mtp_unsolvable: str = ""  # why the family's MTP block cannot be run in process (its weights are then RTN)
    acts: int = 0  # the calibration activations (samples x seq_len x hidden)
    carry: int = 0  # what each layer carries to the next beside them, for every window
    workspace: int = 0  # the largest transient of one layer forward over one batch
    resident: int = 0  # the text model outside the layers and the layer kwargs (causal mask)
    token_bytes: int = 0  # the calibration tokens
    hidden: int = 0
    ranks: int = 1  # torch.distributed ranks (`--ranks`, torchrun), each on a device of devices[0]'s kind

    @property
    def every(self) -> list[LayerPlan]:
        return self.plans + [m.plan for m in self.mtp_plans]

    @property
    def first_is_cpu(self) -> bool:
        return _is_cpu(self.devices[0])

    @property
    def cpu_workers(self) -> int:
        return sum(_is_cpu(d) for d in self.devices)

    @property
    def gathered(self) -> int:
        """Devices other than the first: each solves groups whose weights are gathered from the first."""
        return sum(d != self.devices[0] for d in self.devices)

    @property
    def at_once(self) -> int:
        """Solver groups held at once on the first device: one per CPU worker when it is a CPU."""
        return self.cpu_workers if self.first_is_cpu else 1

    def device0(self, p: LayerPlan, groups_at_once: int, hessians: int | None = None) -> tuple[int, str]:
        """(peak bytes, phase) of layer plan `p` on the first device, `hessians` the Hessians of its largest pass
        (default: as planned)."""
        h = p.hessian_bytes if hessians is None else hessians
        mtp = next((m for m in self.mtp_plans if m.plan is p), None)
        if mtp is not None:
            return self._mtp_device0(mtp, groups_at_once, h)
        held = self.resident + self.acts + self.carry + p.layer_bytes
        phases = {"loading the layer": held + p.load_extra,
                  "collecting Hessians": held + h + self.workspace,
                  "solving": held + h + p.solve_bytes * groups_at_once + p.gather_bytes * self.gathered,
                  "running the layer forward to the next one": self.resident + 2 * (self.acts + self.carry)
                  + p.layer_bytes + self.workspace}
        phase = max(phases, key=phases.get)
        return phases[phase], phase

    def _mtp_device0(self, m: MtpPlan, groups_at_once: int, h: int) -> tuple[int, str]:
        """`loop.LayerLoop.run_mtp`: the last main layer's outputs and carried returns stay held throughout; the draft's
        final-normed inputs (`prev`) until its decoder inputs z (one per fed token) are made; the decoder layer
        and its BF16 glue; its state read from the source while it loads (host memory, beside the layer); the
        draft's outputs beside z when a next draft layer is fed them."""
        dtype_bytes = 4 if self.dtype == "float32" else 2
        cal = self.settings.calibration
        p, z = m.plan, m.tokens * self.hidden * dtype_bytes
        base = self.resident + self.acts + self.carry + p.layer_bytes + m.glue_bytes
        # per batch while z is made: the embedding and its zeroed copy, both norms, the [2H] concat, eh_proj's output
        making = self.batch * cal.seq_len * self.hidden * dtype_bytes * 7
        phases = {"loading the MTP layer": base + self.acts + (m.source_bytes + m.stack_extra if self.first_is_cpu
                                                               else 0),
                  "making the MTP layer's inputs": base + self.acts + z + making,
                  "collecting the MTP layer's Hessians": base + z + h + self.workspace,
                  "solving the MTP layer": base + z + h + p.solve_bytes * groups_at_once
                  + p.gather_bytes * self.gathered}
        if m is not self.mtp_plans[-1]:
            phases["running the MTP layer forward to the next one"] = base + 2 * z + self.workspace
        phase = max(phases, key=phases.get)
        return phases[phase], phase

    @property
    def worst(self) -> LayerPlan:
        """The layer of the first device's peak."""
        return max(self.every, key=lambda p: self.device0(p, self.at_once)[0])

    @property
    def solve_max(self) -> int:
        """The largest solver group: what every other device holds."""
        return max(p.solve_bytes for p in self.every)

    @property
    def parts(self) -> int:
        """The solved codes and scales of two layers, on the host."""
        return 2 * max(p.parts_bytes for p in self.every)

    @property
    def mapped(self) -> int:
        """The source pages mapped while layers are read (`SourceReader.REMAP_BYTES` at most)."""

        return min(SourceReader.REMAP_BYTES, self.resident + sum(p.layer_bytes for p in self.every))

    @property
    def mtp_source(self) -> int:
        """An MTP layer's state read from the source while it loads (host memory)."""
        return max([m.source_bytes + m.stack_extra for m in self.mtp_plans], default=0)

    @property
    def host(self) -> int:
        """The host's peak: with a CPU first device everything on it, else what the host holds beside."""
        base = self.parts + self.token_bytes + self.mapped
        if self.first_is_cpu:
            return self.device0(self.worst, self.at_once)[0] + base
        return base + max(self.solve_max * self.cpu_workers, self.mtp_source)


def _is_cpu(device: str) -> bool:
    import torch

    return torch.device(device).type == "cpu"


def memory_model(src: str, *, method: str = "gptq", scheme: str = DEFAULT_SCHEME, recipe: str | None = None,
                 devices: str = "auto", workers: int = 1, settings=None, ranks: int = 1) -> MemoryModel:
    """The run `quant quantize SRC --method ... --dry-run` describes, and for --method gptq what it holds
    (`settings`: the run's GptqSettings)."""
    import torch


    if method not in ("rtn", "gptq"):
        raise QuantError(f"unknown method {method!r}; choose rtn or gptq")
    if workers < 1:
        raise QuantError(f"--workers {workers}: must be at least 1")
    if ranks < 1:
        raise QuantError(f"--ranks {ranks}: must be at least 1")
    scheme_obj = get_scheme(scheme)
    if method == "gptq" and scheme not in MXFP4_SCHEMES:
        raise QuantError(f"--method gptq solves MXFP4 weights; scheme {scheme} has none (use w_mxfp4_a_mxfp4 "
                         f"or w_mxfp4)")
    root, config = config_dir(src)
    family = family_for_config(config, root / "config.json")
    recipe_obj = load_recipe(recipe, family)
    cfg = text_config(config)
    mtp = mtp_layout(config, family)
    model = MemoryModel(config_path=root / "config.json", family=family.name,
                        decoder_layers=cfg.get("num_hidden_layers"), mtp=list(mtp.decoder_layers), scheme=scheme,
                        recipe=recipe_obj.name, mtp_layer=recipe_obj.mtp_layer, method=method,
                        mtp_unsolvable=mtp.draft.unsupported if mtp.draft else "",
                        devices=_device_list(devices, workers), ranks=ranks)
    if method == "rtn":
        return model


    settings = settings or GptqSettings()
    dtype = torch.float32 if _is_cpu(model.devices[0]) else torch.bfloat16
    dtype_bytes = 4 if dtype == torch.float32 else 2
    meta = config_model(root, dtype, lambda why: QuantError(f"--method gptq cannot run {family.name}: {why}"))
    cal = settings.calibration
    tokens = cal.samples * cal.seq_len
    batch = min(settings.batch, cal.samples)
    values = {**{k: v for k, v in cfg.items() if isinstance(v, int) and not isinstance(v, bool)},
              "seq_len": cal.seq_len, "dtype_bytes": dtype_bytes}
    hidden = int(cfg["hidden_size"])
    carry_exprs = family.layer_memory.get("carry_bytes_per_token") or {}
    workspace_expr = family.layer_memory.get("workspace_bytes_per_token")
    text = meta.get_decoder()
    resident = sum(p.numel() for n, p in text.named_parameters() if not n.startswith("layers.")) * dtype_bytes
    resident += batch * cal.seq_len * cal.seq_len  # the causal mask the layers are handed (bool [B, 1, S, S])
    model.settings, model.dtype, model.batch, model.hidden = settings, str(dtype).replace("torch.", ""), batch, hidden
    # GPTQ solves what the plan quantizes to MXFP4: the planner's own rule, asked of every module
    solved = solved_rule(ModuleTreatment(family, recipe_obj, scheme_obj, mtp))
    model.plans = plan_layers(meta, family, solved, settings, dtype_bytes)
    model.mtp_plans = plan_mtp(root, config, family, mtp, solved, settings, dtype, dtype_bytes, cal.samples,
                               cal.seq_len)
    model.acts = tokens * hidden * dtype_bytes
    model.carry = sum(tokens * family_expression(carry_exprs[name], values, f"carry_bytes_per_token.{name}")
                      for name in family.layer_returns[1:] if name in carry_exprs)
    model.workspace = batch * cal.seq_len * family_expression(workspace_expr, values, "workspace_bytes_per_token") \
        if workspace_expr else 0
    model.resident, model.token_bytes = resident, tokens * 8
    return model


def predict(src: str, *, method: str = "gptq", scheme: str = DEFAULT_SCHEME, recipe: str | None = None,
            devices: str = "auto", workers: int = 1, settings=None, device_memory: int | None = None,
            ranks: int = 1) -> Prediction:
    """The dry run's prediction (see the module docstring); `settings` is the run's GptqSettings; `ranks`: the
    run on that many torch.distributed ranks, each on a device like the first of `devices` (`_say_ranks`)."""
    return render(memory_model(src, method=method, scheme=scheme, recipe=recipe, devices=devices, workers=workers,
                               settings=settings, ranks=ranks), device_memory)


def render(model: MemoryModel, device_memory: int | None = None) -> Prediction:
    """The dry run's report of `model`: its lines, and the peaks and passes they state; whether each device fits
    is checked against its memory (`device_memory` for accelerators not on this machine)."""
    out = Prediction()
    say = out.lines.append
    say(_header_line(model))
    if model.method == "rtn":
        say("method rtn: no calibration and no Hessians; each worker rounds one source shard at a time "
            "(its peak is about one shard in and its output; shard sizes are not in config.json)")
        return out
    _say_calibration(model, say)
    _say_peaks(model, out)
    out.passes = {p.index: p.passes for p in model.plans}
    out.mtp_passes = {m.plan.index: m.plan.passes for m in model.mtp_plans}
    _say_fit(model, device_memory, say)
    if model.ranks > 1:
        _say_ranks(model, out, device_memory)
    return out


def _say_ranks(model: MemoryModel, out: Prediction, device_memory: int | None) -> None:
    """The same run on `model.ranks` torch.distributed ranks (`quant.gptq.ranks`), per rank: the busiest rank's
    share of the calibration batches (contiguous shares), run through each layer twice (the pass that records the
    solved weights' inputs, in host memory, and the forward to the next layer); each layer's Hessians owned by
    the ranks, about 1/N of the routed experts (and of the plain linears' Hessians) each, balanced by cost on an
    assumed even routing, collected in as few sweeps over the recorded inputs as keep each within
    --hessian-budget (one pass per layer where one sweep). Per rank: its device's peak (the layer whole, its
    share of the activations, one sweep's Hessians and one solver group) and its host memory (the inputs its
    share recorded, one batch of them received from another rank, the solved codes and scales of two layers,
    which every rank holds, the tokens and the mapped source pages)."""
    say = out.lines.append
    n, cal = model.ranks, model.settings.calibration
    budget = model.settings.hessian_bytes
    dtype_bytes = 4 if model.dtype == "float32" else 2
    batches = -(-cal.samples // model.batch)
    share = -(-batches // n)
    tokens = min(share * model.batch, cal.samples) * cal.seq_len
    frac = tokens / (cal.samples * cal.seq_len)
    acts, carry = int(model.acts * frac), int(model.carry * frac)

    def per_rank(budget: int) -> tuple[int, tuple, int, dict[int, int]]:
        """(device peak, (layer, phase) of it, host peak, sweeps per layer) with `budget` of Hessians a sweep."""
        peak, host, where, sweeps_of = 0, 0, None, {}
        for p in model.every:
            owned = -(-p.experts // n) * p.per_expert
            sweeps_of[p.index] = -(-owned // budget) if owned else (1 if p.weights else 0)
            hessians = min(owned, max(budget, p.per_expert)) + -(-p.plain_hessians // n)
            held = model.resident + acts + carry + p.layer_bytes
            phases = {"loading the layer": held + p.load_extra,
                      "collecting its Hessians": held + hessians + model.workspace,
                      "solving": held + hessians + p.solve_bytes,
                      "running the layer forward to the next one": model.resident + 2 * (acts + carry)
                      + p.layer_bytes + model.workspace}
            recorded = (tokens + model.batch * cal.seq_len) * p.input_width * dtype_bytes
            phase = max(phases, key=phases.get)
            if phases[phase] > peak:
                peak, where = phases[phase], (p.index, phase)
            host = max(host, recorded + model.parts + model.token_bytes + model.mapped)
        return peak, where, host, sweeps_of

    peak, where, host, out.rank_sweeps = per_rank(budget)
    cpu = model.first_is_cpu
    by_sweeps: dict[int, list[int]] = {}
    for index, sweeps in out.rank_sweeps.items():
        by_sweeps.setdefault(sweeps, []).append(index)
    say(f"on {n} ranks (--ranks {n}, or torchrun): each rank runs at most {share} of the {batches} calibration "
        f"batches ({tokens:,} tokens) through every layer, twice (the pass that records the solved weights' inputs "
        f"and the forward to the next layer); each layer's Hessians are owned by the ranks, about "
        f"1/{n} each, fed the recorded inputs in batch order:")
    for sweeps, layers in sorted(by_sweeps.items()):
        say(f"  {sweeps} Hessian sweep{'s' * (sweeps != 1)} per rank: {_ranges(layers)}")
    device = "the CPU (device and host are one memory)" if cpu else f"its {model.devices[0].split(':')[0]} device"
    say(f"  per rank, on {device}: {human(peak + (host if cpu else 0))} (layer {where[0]}, while {where[1]}); "
        + ("" if cpu else f"host {human(host)} ") + f"[its share of the activations {human(acts)}, the recorded "
        f"inputs and one batch received {human(host - model.parts - model.token_bytes - model.mapped)}, solved codes "
        f"of two layers {human(model.parts)}]" + (f"; {n} ranks on one machine: {human(n * (peak + host))}" if cpu
                                                   else ""))
    out.peaks["rank"] = peak + (host if cpu else 0)
    out.peaks["rank host"] = host
    capacity = None if cpu else _capacity(model.devices[0], device_memory)
    if capacity is not None:
        verdict = "fits" if peak <= capacity else "DOES NOT FIT"
        say(f"  {verdict} on each rank's device: {human(peak)} of {human(capacity)}")
    most = max((-(-p.experts // n) * p.per_expert for p in model.every), default=0)
    if most > budget:  # one sweep per layer: a budget that holds a rank's share of the largest layer
        gib = -(-most // GIB)
        one = per_rank(gib * GIB)[0]
        room = "" if capacity is None else (f", fits in {HEADROOM:.0%} of the device" if one <= HEADROOM * capacity
                                            else f", more than {HEADROOM:.0%} of the device")
        say(f"  one sweep per layer with --hessian-budget {gib}GiB: {human(one + (host if cpu else 0))} per rank"
            f"{room}")


def _header_line(model: MemoryModel) -> str:
    mtp = model.mtp
    return (f"dry run: {model.config_path} ({model.family}; {model.decoder_layers} decoder layers"
            + (f" + {len(mtp)} MTP layer{'s' * (len(mtp) > 1)}" if mtp else "") + f"), {model.scheme}, recipe "
            f"{model.recipe}, method {model.method}, devices {','.join(model.devices)}")


def _say_calibration(model: MemoryModel, say) -> None:
    """The calibration set, and the passes each layer (decoder and MTP) takes to collect its Hessians."""
    settings, plans = model.settings, model.plans
    cal = settings.calibration
    say(f"calibration: {cal.samples} windows x {cal.seq_len} tokens, {model.batch} per forward, compute dtype "
        f"{model.dtype}; Hessian budget per pass {human(settings.hessian_bytes)} (--hessian-budget)")
    by_passes: dict[int, list[int]] = {}
    for p in plans:
        by_passes.setdefault(p.passes, []).append(p.index)
    say("calibration passes per layer (forwards over every window, each collecting one share of the expert "
        "Hessians):")
    for n, layers in sorted(by_passes.items()):
        example = next(p for p in plans if p.index == layers[0])
        detail = (f"; {example.experts_per_pass} experts per pass, {human(example.hessians_total)} of Hessians "
                  f"in all" if example.experts_per_pass else "")
        what = f"{example.weights} weights solved{detail}" if n else "nothing to solve: forward only"
        say(f"  {n} pass{'es' * (n != 1)}: {_ranges(layers)} ({what})")
    for m in model.mtp_plans:
        p = m.plan
        detail = (f"; {p.experts_per_pass} experts per pass, {human(p.hessians_total)} of Hessians in all"
                  if p.experts_per_pass else "")
        say(f"  {p.passes} pass{'es' * (p.passes != 1)}: MTP layer {p.index} ({p.weights} weights solved{detail}; "
            f"fed {m.tokens} tokens through enorm/hnorm/eh_proj)")
    gptq_layers = [p for p in plans if p.weights]
    say(f"  {sum(p.passes for p in plans)} passes over {len(plans)} layers; "
        f"{sum(p.weights for p in gptq_layers)} weights solved"
        + (f"; MTP {_ranges(model.mtp)} {_mtp_note(model)}" if model.mtp else ""))


def _mtp_note(model: MemoryModel) -> str:
    """What becomes of the MTP layers: kept BF16, solved after the decoder layers, or nothing to solve."""
    mtp_plans = model.mtp_plans
    solved_mtp = sum(m.plan.passes for m in mtp_plans)
    if model.mtp_layer == "bf16":
        return "kept BF16 by the recipe"
    if mtp_plans:
        return (f"solved after them, fed as the engines run the draft ({solved_mtp} more "
                f"pass{'es' * (solved_mtp != 1)}, {sum(m.plan.weights for m in mtp_plans)} weights)")
    if model.mtp_unsolvable:
        return f"rounded to nearest, not solved: no in-process MTP draft ({model.mtp_unsolvable})"
    return "nothing to solve there (the recipe keeps its weights BF16, or the release publishes none)"


def _say_peaks(model: MemoryModel, out: Prediction) -> None:
    """The predicted peak of the first device (with its parts), of the other accelerators and of the host."""
    say = out.lines.append
    device_list, worst, solve_max = model.devices, model.worst, model.solve_max
    peak0, phase = model.device0(worst, model.at_once)
    worst_name = f"MTP layer {worst.index}" if any(m.plan is worst for m in model.mtp_plans) else str(worst.index)
    say(f"predicted peak memory (worst layer: {worst_name}, while {phase}; not counting the process's fixed "
        f"cost: runtime, CUDA context, kernels):")
    say(f"  {device_list[0]}: {human(peak0)}  [activations {human(model.acts)}"
        + (f" + carried {human(model.carry)}" if model.carry else "") + f" (x2 in the forward), layer "
        f"{human(worst.layer_bytes)}, Hessians {human(worst.hessian_bytes)} per pass, solver "
        f"{human(worst.solve_bytes)} per group, forward workspace {human(model.workspace)}, embedding and mask "
        f"{human(model.resident)}]")
    out.peaks[f"device:{device_list[0]}"] = peak0
    for d in device_list[1:]:
        if _is_cpu(d):
            continue
        out.peaks[f"device:{d}"] = solve_max
    others = _other_accelerators(model)
    if others:
        say(f"  {_devices(others)}: {human(solve_max)}{' each' * (len(others) > 1)}  [the solver's working set of "
            f"one group of experts]")
    say(_host_line(model))
    out.peaks["host"] = model.host


def _other_accelerators(model: MemoryModel) -> list[str]:
    return [d for d in model.devices[1:] if not _is_cpu(d)]


def _host_line(model: MemoryModel) -> str:
    first_is_cpu, cpu_workers = model.first_is_cpu, model.cpu_workers
    return (f"  host: {human(model.host)}  [" + ("everything above" + (f", {cpu_workers} solver groups at once"
                                                                      if cpu_workers > 1 else "") + ", "
                                                if first_is_cpu else "")
            + f"solved codes and scales of two layers {human(model.parts)}, "
            f"calibration tokens {human(model.token_bytes)}, mapped source pages {human(model.mapped)}"
            + (f", the MTP layer's state read from the source while it loads {human(model.mtp_source)}"
               if not first_is_cpu and model.mtp_source > model.solve_max * cpu_workers else "") + "]")


def _say_fit(model: MemoryModel, device_memory: int | None, say) -> None:
    """Does it fit? One line per device (accelerators of one capacity and need together)."""
    device_list, solve_max, host = model.devices, model.solve_max, model.host
    peak0 = model.device0(model.worst, model.at_once)[0]
    others = _other_accelerators(model)
    shown: set = set()
    for d in dict.fromkeys(device_list):
        capacity = _capacity(d, device_memory)
        if d != device_list[0] and not _is_cpu(d):
            if (capacity, solve_max) in shown:
                continue
            shown.add((capacity, solve_max))
            same = [o for o in others if _capacity(o, device_memory) == capacity]
            d = _devices(same)
        need = host if d == "cpu" else peak0 if d == device_list[0] else solve_max
        if capacity is None:
            say(f"  {d}: capacity unknown (give --device-memory, e.g. 80GB)")
        elif need > capacity:
            say(f"  DOES NOT FIT on {d}: needs {human(need)} of {human(capacity)}; {_advice(model, capacity)}")
        elif d == device_list[0] and any(p.per_expert for p in model.every):
            say(f"  fits on {d}: {human(need)} of {human(capacity)}{_fewest_passes_note(model, capacity, peak0)}")
        else:
            say(f"  fits on {d}: {human(need)} of {human(capacity)}")


def _advice(model: MemoryModel, capacity: int) -> str:
    """What to change when a device is too small: the layer alone, or the calibration and the Hessian budget."""
    floor = model.resident + model.worst.layer_bytes + model.worst.load_extra
    if floor >= capacity:
        return f"the layer alone takes {human(floor)} while it loads: a device with more memory"
    return "lower --calib-samples or --calib-seq-len (activations) or --hessian-budget (more passes)"


def _fewest_passes_note(model: MemoryModel, capacity: int, peak0: int) -> str:
    """The fewest passes per MoE layer that fit in HEADROOM of the first device, when fewer than planned."""
    every, at_once = model.every, model.at_once
    fewest, budget = _fewest_passes(every, HEADROOM * capacity - (model.host - peak0 if model.first_is_cpu else 0),
                                    lambda p, h: model.device0(p, at_once, h)[0])
    if fewest and fewest < max(p.passes for p in every):
        return (f"; the fewest passes that fit in {HEADROOM:.0%} of it: {fewest} per MoE layer, with "
                f"--hessian-budget {budget}")
    return ""


def _fewest_passes(plans: list[LayerPlan], room: int, need) -> tuple[int | None, str | None]:
    """The fewest passes per MoE layer, and the --hessian-budget that gives them, with which every layer's peak
    `need(plan, hessian bytes of its largest pass)` stays within `room`. (None, None) when not even one expert
    per pass fits."""
    moe = [p for p in plans if p.per_expert]
    for passes in range(1, max(p.experts for p in moe) + 1):
        chunk = max(-(-p.experts // passes) for p in moe)
        budget = chunk * max(p.per_expert for p in moe)
        if all(need(p, p.plain_hessians + min(chunk, p.experts) * p.per_expert) <= room for p in moe):
            fewest = max(-(-p.experts // chunk) for p in moe)
            mib = -(-budget // (1 << 20))
            return fewest, f"{mib // 1024}GiB" if mib % 1024 == 0 else f"{mib}MiB"
    return None, None


def _ranges(indices) -> str:
    indices = sorted(indices)
    if not indices:
        return "none"
    parts, start, prev = [], indices[0], indices[0]
    for i in indices[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(f"layer {start}" if start == prev else f"layers {start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(parts)


def _devices(devices: list[str]) -> str:
    return devices[0] if len(devices) == 1 else f"{devices[0]} .. {devices[-1]} ({len(devices)} devices)"
