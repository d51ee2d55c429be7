"""The model card (`README.md`) written into every export, in the Hugging Face model-card convention.

It is rendered from the export's own records only (quant_manifest.json, config.json, the source's README front
matter), so it is deterministic: what was quantized and how, what stays BF16 and why, the exclusion list,
per-role error figures, serve commands for SGLang and vLLM, and the command that reproduces the export. The
accuracy section is a placeholder between markers that `quant eval --card` fills in.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import yaml

CARD_FILE = "README.md"
ENGINE_NAMES = {"sglang": "SGLang", "vllm": "vLLM"}  # the serving engines a card gives commands for
ACCURACY_START = "<!-- quant:accuracy:start -->"
ACCURACY_END = "<!-- quant:accuracy:end -->"
SCHEME_WORDS = {
    "w_mxfp4_a_mxfp4": ("MXFP4", "MXFP4 weights (OCP E2M1, one E8M0 scale per 32 inputs) with dynamic MXFP4 "
                        "activations"),
    "w_mxfp4": ("MXFP4", "MXFP4 weights (OCP E2M1, one E8M0 scale per 32 inputs), BF16 activations"),
    "fp8": ("FP8", "FP8 E4M3 weights with per-channel scales and dynamic per-token FP8 activations"),
    "fp8-block": ("FP8", "FP8 E4M3 weights with 128x128 block scales (the DeepSeek/GLM official format)"),
}
KEEP_REASONS = {
    "keep": "embeddings, lm_head, routers and their correction bias, norms, MTP glue: left BF16 by every recipe "
            "(what the official releases keep)",
    "no role": "no quantizable role in this model family (e.g. a vision tower, convolutions)",
    "mtp_keep": "the MTP layer's glue (eh_proj, enorm, hnorm, shared_head): engines build eh_proj as a plain "
                "linear",
}


def _front_matter(text: str) -> dict:
    m = re.match(r"^---\n(.*?)\n---\n", text, re.S)
    if not m:
        return {}
    try:
        data = yaml.safe_load(m.group(1))
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def _source_name(source_ref: str) -> str:
    """A hub id as given; a local directory by its name (the card must not leak the machine's paths)."""
    return source_ref if re.fullmatch(r"[\w.-]+/[\w.-]+", source_ref) and not Path(source_ref).exists() \
        else Path(source_ref).name


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _role_table(tensors: dict) -> list[str]:
    by_role: dict[str, list[dict]] = defaultdict(list)
    for rec in tensors.values():
        if rec.get("action") == "quantize":
            by_role[(rec.get("role") or "?", rec.get("scheme") or "?")].append(rec)
    lines = ["| role | scheme | modules | mean rel. MSE | worst rel. MSE | min SQNR (dB) |",
             "|---|---|---|---|---|---|"]
    for (role, scheme), recs in sorted(by_role.items()):
        # Error figures of extreme weights can overflow float32 sums (a source value near 3e38): such records
        # hold None or a non-finite number and are left out of the summary, not allowed to break it.
        mse = [r["rel_mse"] for r in recs if _finite(r.get("rel_mse"))]
        sqnr = [r["sqnr_db"] for r in recs if _finite(r.get("sqnr_db"))]
        lines.append(f"| {role} | {scheme} | {len(recs)} | "
                     + (f"{sum(mse) / len(mse):.3%} | {max(mse):.3%} | " if mse else "| | ")
                     + (f"{min(sqnr):.1f} |" if sqnr else " |"))
    return lines


def _kept_table(tensors: dict) -> list[str]:
    kept: dict[str, int] = defaultdict(int)
    for rec in tensors.values():
        if rec.get("action") == "copy" and len(rec.get("source_shape") or []) == 2 and rec.get("role") != "sidecar":
            kept[rec.get("role") or "no role"] += 1  # sidecars keep their release dtype: _sidecar_section
    lines = ["| role | BF16 weights | why |", "|---|---|---|"]
    for role, n in sorted(kept.items()):
        why = KEEP_REASONS.get(role, f"the recipe leaves the {role} role unquantized")
        lines.append(f"| {role} | {n} | {why} |")
    return lines


def _method_words(settings: dict) -> str:
    if settings.get("method") != "gptq":
        return "round-to-nearest"
    c = settings["calibration"]
    data = c["data"] if c["identity"].startswith("hub:") else f"{Path(c['data']).name} ({c['identity'][:15]}…)"
    return (f"GPTQ (error-aware rounding, damping {settings['damp']}, calibrated on {c['samples']} windows of "
            f"{c['seq_len']} tokens of {data}; same MXFP4 format as round-to-nearest)")


def _method_args(settings: dict) -> str:
    if settings.get("method") != "gptq":
        return ""
    c = settings["calibration"]
    return (f" \\\n    --method gptq --calib-data {c['data']} --calib-samples {c['samples']} "
            f"--calib-seq-len {c['seq_len']} --calib-seed {c['seed']} --damp {settings['damp']}")


@dataclass(frozen=True)
class _Source:
    """How the card names the source: a hub id (the card's base_model), or a local directory by its name."""

    base: str     # the hub id as given, or the local directory's name
    hub: bool
    hub_id: str   # the hub id without hf://, or the name again for a local source

    @classmethod
    def of(cls, source_ref: str) -> "_Source":
        base = _source_name(source_ref)
        hub = source_ref.startswith("hf://") or (base == source_ref and "/" in base)
        return cls(base=base, hub=hub, hub_id=source_ref[len("hf://"):] if source_ref.startswith("hf://") else base)


def render_card(manifest: dict, config: dict, source_ref: str, source_readme: str | None) -> str:
    settings = manifest["settings"]
    scheme = settings["scheme"]
    short, words = SCHEME_WORDS.get(scheme, (scheme, scheme))
    source = _Source.of(source_ref)
    serve_on = _serving_engines(manifest)
    lines = [
        *_card_header(source, short, source_readme, config), "",
        *_intro(manifest, config, source, words, serve_on), "",
        *_recipe_section(manifest), "",
        *_kept_section(manifest, config), "",
        *_sidecar_section(manifest),
        *_error_section(manifest), "",
        *_serve_section(manifest, serve_on, config), "",
        *_accuracy_placeholder(), "",
        *_reproduce_section(manifest, source, short), "",
    ]
    return "\n".join(lines)


def _card_header(source: _Source, short: str, source_readme: str | None, config: dict) -> list[str]:
    """The YAML front matter (library, tags, the hub base model, the source's license) and the title."""
    source_meta = _front_matter(source_readme or "")
    # base_model is a hub id by the convention (ORG/NAME: the Hub refuses ORG/NAME@REVISION there; the revision is
    # in the reproduce command and the manifest); a local source has none to give (its path is in the manifest).
    method = str((config.get("quantization_config") or {}).get("quant_method") or "")
    meta = {"library_name": "transformers", "tags": sorted({short.lower(), method, "moe", "moe-quant"} - {""}),
            **({"base_model": source.hub_id.partition("@")[0]} if source.hub else {})}
    if source_meta.get("license"):
        meta["license"] = source_meta["license"]
    return ["---", yaml.safe_dump(meta, sort_keys=True).strip(), "---", "", f"# {source.base} ({short})"]


def _format_words(config: dict) -> str:
    """The checkpoint format as the written config.json declares it (not the run's intent)."""
    q = config.get("quantization_config") or {}
    method = q.get("quant_method")
    if method == "quark":
        return "the AMD Quark checkpoint format (`quant_method: quark`)"
    if method == "fp8" and q.get("weight_block_size"):
        return (f"the official block-FP8 format (`quant_method: fp8`, `weight_block_size: "
                f"{list(q['weight_block_size'])}`, as the DeepSeek/GLM releases ship it)")
    return f"the `quant_method: {method}` format"


def _exclude_key(config: dict) -> tuple[str, list]:
    """(the key config.json lists its unquantized modules under, the list): Quark's `exclude`, the official block-FP8
    config's `modules_to_not_convert`."""
    q = config.get("quantization_config") or {}
    for key in ("exclude", "modules_to_not_convert", "ignored_layers", "ignore"):
        if isinstance(q.get(key), list):
            return key, q[key]
    return "exclude", []


def _intro(manifest: dict, config: dict, source: _Source, words: str, serve_on: list[str]) -> list[str]:
    settings = manifest["settings"]
    arch = (config.get("architectures") or ["?"])[0]
    source_words = f"`{source.hub_id}`" if source.hub else f"The local checkpoint `{source.base}`"
    engine_words = " and ".join(ENGINE_NAMES[e] for e in serve_on) or "no serving engine"
    return [f"{source_words} ({arch}) quantized with moe-quant {settings.get('version', '')}: {words}, scale rule "
            f"`{settings.get('scale_mode', 'even')}`, {_method_words(settings)}, in {_format_words(config)} that "
            f"{engine_words} load."]


def _recipe_section(manifest: dict) -> list[str]:
    recipe, scheme = manifest["recipe"], manifest["settings"]["scheme"]
    return ["## Recipe", "",
            f"`{recipe['name']}`: {recipe.get('description', '')}.",
            "Roles and what they get: " + ", ".join(f"{role} → {scheme if what == 'scheme' else what}"
                                                    for role, what in sorted(recipe["roles"].items())) + "."]


def _kept_section(manifest: dict, config: dict) -> list[str]:
    """What stays BF16 and why, and what the exclusion list holds."""
    key, exclude = _exclude_key(config)
    aliases = [e for e in exclude if e.startswith(("model.decoder.", "model.eh_proj", "model.enorm", "model.hnorm",
                                                   "model.shared_head", "language_model.", "visual."))]
    return ["## What stays BF16 and why", "",
            *_kept_table(manifest["tensors"]), "",
            f"`quantization_config.{key}` lists {len(exclude)} entries: every BF16 linear under each name an "
            f"engine looks it up by"
            f"{f', including {len(aliases)} engine-runtime aliases (MTP or wrapper names)' if aliases else ''}.",
            ]


def _sidecar_section(manifest: dict) -> list[str]:
    """The sidecars carried over as stored (quant_manifest.json `sidecars`); nothing when there are none."""
    rows = []
    for sidecar in manifest.get("sidecars") or []:
        if sidecar.get("file"):
            rows.append(f"| {sidecar['name']} | {sidecar['kind']} | `{sidecar['file']['name']}` | file | as stored |")
        for name, rec in (sidecar.get("tensors") or {}).items():
            shape = "x".join(map(str, rec["shape"])) if rec else "missing"
            rows.append(f"| {sidecar['name']} | {sidecar['kind']} | `{name}` | {rec['dtype'] if rec else '-'} | "
                        f"{shape} |")
    if not rows:
        return []
    return ["## Sidecars (carried over as stored)", "",
            "Declared by the source's config and copied byte for byte (sha256 of each in quant_manifest.json "
            "`sidecars`); `quant verify-manifest` fails an export without them.", "",
            "| sidecar | kind | tensor / file | dtype | shape |", "|---|---|---|---|---|", *rows, ""]


def _error_section(manifest: dict) -> list[str]:
    return ["## Quantization error per role", "",
            *_role_table(manifest["tensors"]), "",
            "Relative MSE and SQNR of each quantized weight against its source (quant_manifest.json lists every "
            "tensor with source and output sha256)."]


def _serving_engines(manifest: dict) -> list[str]:
    """The engines (of ENGINE_NAMES, in its order) that load the export's scheme."""
    loads_in = (manifest.get("engines") or {}).get("scheme_loads_in") or ["sglang", "vllm"]
    return [e for e in ENGINE_NAMES if any(x.split("==")[0] == e for x in loads_in)]


def _has_mtp(manifest: dict) -> bool:
    return bool(manifest.get("mtp_layers")) or any(n.startswith("mtp.") for n in manifest["tensors"])


GPU_BYTES = 80e9  # one accelerator of the class these models are served on (H100 80 GB; MI300X/MI355X hold more)
WEIGHT_SHARE = 0.7  # of each GPU's memory for weights, the rest for the KV cache and activations


def _size(nbytes: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} bytes"


def tensor_parallel(manifest: dict, config: dict) -> int:
    """The TP degree the serve commands use: the fewest GPUs (1, 2, 4, 8, 16) whose memory holds the export's weights
    in WEIGHT_SHARE of each, among those dividing the attention heads (the engines shard heads evenly)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    heads = text.get("num_attention_heads") if isinstance(text.get("num_attention_heads"), int) else 1
    weights = (manifest.get("summary") or {}).get("output_bytes") or 0
    degrees = [tp for tp in (1, 2, 4, 8, 16) if heads % tp == 0] or [1]
    return next((tp for tp in degrees if tp * GPU_BYTES * WEIGHT_SHARE >= weights), degrees[-1])


def _serve_commands(manifest: dict, mtp: bool, tp: int) -> dict[str, str]:
    """The SGLang and vLLM commands that serve the export from its directory (the export is `.`) on `tp` GPUs."""
    tensors = manifest["tensors"].values()
    shared_bf16 = any(r.get("role") == "shared_experts" and r.get("action") == "copy" for r in tensors)
    routed_q = any(r.get("role") == "routed_experts" and r.get("action") == "quantize" for r in tensors)
    sglang = f"python -m sglang.launch_server --model-path . --tp {tp} --trust-remote-code"
    if shared_bf16 and routed_q:
        sglang += " --disable-shared-experts-fusion"
    vllm = f"vllm serve . --tensor-parallel-size {tp}"
    if mtp:  # the same draft depth as `quant eval --mtp-depth` (3)
        sglang += (" \\\n    --speculative-algorithm EAGLE --speculative-num-steps 3 --speculative-eagle-topk 1 "
                   "--speculative-num-draft-tokens 4")
        vllm += " \\\n    --speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 3}'"
    return {"sglang": sglang, "vllm": vllm}


def _serve_section(manifest: dict, serve_on: list[str], config: dict) -> list[str]:
    """The serve commands of the engines that load the scheme, and what the preflight checked when written."""
    mtp = _has_mtp(manifest)
    tp = tensor_parallel(manifest, config)
    commands = _serve_commands(manifest, mtp, tp)
    lines = ["## Serve", "", "Run from this directory (the export is `.`).", ""]
    for engine in serve_on:
        lines += [f"{ENGINE_NAMES[engine]}:", "", "```bash", commands[engine], "```", ""]
    missing = [e for e in ENGINE_NAMES if e not in serve_on]
    if missing:
        lines += [f"{' and '.join(ENGINE_NAMES[e] for e in missing)} cannot load this scheme "
                  f"({manifest['settings']['scheme']}); only the commands above apply.", ""]
    engines = manifest.get("engines") or {}
    checked, refused = engines.get("checked") or [], engines.get("refused_by") or {}
    loads = [c for c in checked if c not in refused]
    checked_words = (f"The export passed the preflight for {', '.join(loads)} when it was written."
                     if checked else "The export was written without the engine self-check (--check-engines '').")
    if refused:
        checked_words += (f" {', '.join(refused)} cannot load it (the preflight's reason is in quant_manifest.json, "
                          "engines.refused_by).")
    weights = (manifest.get("summary") or {}).get("output_bytes") or 0
    lines.append(f"Tensor parallel {tp}: the fewest {GPU_BYTES / 1e9:.0f} GB GPUs that hold the {_size(weights)} "
                 f"of weights in {WEIGHT_SHARE:.0%} of their memory (the rest for the KV cache) and divide the "
                 "attention heads; "
                 + ("the MTP flags enable speculative decoding with the checkpoint's MTP layer, three draft tokens "
                    "as `quant eval` measures it." if mtp else "this model has no MTP layer.")
                 + f" {checked_words} Check it against an engine release with `quant verify-manifest . --engine "
                 "vllm==0.32`.")
    return lines


def _accuracy_placeholder() -> list[str]:
    return ["## Accuracy", "", ACCURACY_START,
            "Not evaluated yet. `quant eval --candidate . --baseline <FP8 baseline> --card .` (from this directory) "
            "fills this section.", ACCURACY_END]


def _reproduce_section(manifest: dict, source: _Source, short: str) -> list[str]:
    """The command that writes the same export again, from the hub id or a local SOURCE."""
    settings, recipe = manifest["settings"], manifest["recipe"]
    recipe_arg = (f" --recipe {manifest['recipe_file']}" if manifest.get("recipe_file")
                  else "" if recipe["name"] == "experts-only" else f" --recipe {recipe['name']}")
    scale_arg = "" if settings.get("scale_mode", "even") == "even" else f" --scale-mode {settings['scale_mode']}"
    where = "" if source.hub else (f", with SOURCE the path of the local checkpoint `{source.base}` (its shards' "
                                   f"sha256 are in quant_manifest.json)")
    return ["## Reproduce", "", f"From this directory{where}:", "", "```bash",
            f"quant quantize {source.hub_id if source.hub else 'SOURCE'} ../{source.base.split('/')[-1]}-{short}-again "
            f"--scheme {settings['scheme']}{recipe_arg}{scale_arg}{_method_args(settings)}", "```"]


def _recovery(rec: dict | None) -> str:
    """Candidate ÷ baseline accuracy with its interval, as release cards report "recovery"."""
    if not rec or rec.get("ratio") is None:
        return "-"
    return f"{rec['ratio']:.1%} [{rec['ci_low']:.1%}, {rec['ci_high']:.1%}]"


# How a `quant eval` arm computed its activations (the report's `activations`), as the card says it.
ACTIVATION_MODES = {"emulate": "quantized in process as the export's scheme says (--activations emulate)",
                    "bf16": "in BF16 in process (--activations bf16: weights quantized, activations not)",
                    "server": "as its serving engine computed them"}


def accuracy_section(report: dict, image: str | None) -> str:
    """The card's accuracy section from a `quant eval` report."""
    rows = ["| task | baseline | candidate | Δ (points) | 95% CI | recovery [95% CI] | verdict |",
            "|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        if not row.get("primary"):
            continue
        c = row["comparison"]
        rows.append(f"| {row['label']} ({c['n_questions']} questions) | {c['baseline_accuracy']:.1%} | "
                    f"{c['candidate_accuracy']:.1%} | {100 * c['difference']:+.1f} | "
                    f"[{100 * c['ci_low']:+.1f}, {100 * c['ci_high']:+.1f}] | {_recovery(row.get('recovery'))} | "
                    f"{c['verdict']} |")
    text = [f"Against `{report['baseline'].get('name', 'baseline')}` (margin {report['margin_points']:g} points, "
            f"overall verdict **{report['verdict']}**):", "", *rows]
    for title, lines in (("Why no verdict can be given", report.get("problems")),
                         ("What would decide it", report.get("next_steps"))):
        if lines:  # the report's own reasons, as the terminal and report.md give them
            text += ["", f"{title}:", "", *(f"- {line}" for line in lines)]
    accepted = [row for row in report["rows"] if row.get("acceptance")]
    if accepted:
        depth = report.get("settings", {}).get("mtp_depth")
        text += ["", f"MTP draft acceptance (speculative decoding, margin {report.get('mtp_margin_points', 5):g} "
                     f"points of depth-1 acceptance; accepted length at depth {depth}):", "",
                 "| task | baseline | candidate | Δ (points) | 95% CI | accepted length | verdict |",
                 "|---|---|---|---|---|---|---|"]
        for row in accepted:
            a = row["acceptance"]
            text.append(f"| {row['label']} | {a['baseline_rate']:.1%} | {a['candidate_rate']:.1%} | "
                        f"{100 * a['rate_difference']:+.1f} | [{100 * a['rate_ci_low']:+.1f}, "
                        f"{100 * a['rate_ci_high']:+.1f}] | {a['baseline_length']:.2f} → {a['candidate_length']:.2f} "
                        f"| {a['verdict']} |")
    modes = [(arm, report.get(arm, {}).get("activations")) for arm in ("candidate", "baseline")]
    if any(mode for _, mode in modes):
        text += ["", "Activations: " + "; ".join(f"{arm} {ACTIVATION_MODES.get(mode, mode)}" for arm, mode in modes
                                                 if mode) + "."]
    if image:
        text += ["", f"![paired comparison]({image})"]
    return "\n".join(text)


def replace_accuracy(card: str, section: str) -> str:
    if ACCURACY_START in card and ACCURACY_END in card:
        head, rest = card.split(ACCURACY_START, 1)
        _, tail = rest.split(ACCURACY_END, 1)
        return f"{head}{ACCURACY_START}\n{section}\n{ACCURACY_END}{tail}"
    return card.rstrip("\n") + f"\n\n## Accuracy\n\n{ACCURACY_START}\n{section}\n{ACCURACY_END}\n"


def accuracy_of(card: str) -> str | None:
    """The accuracy section `quant eval --card` wrote into a card, or None (none, or the placeholder)."""
    if ACCURACY_START not in card or ACCURACY_END not in card:
        return None
    section = card.split(ACCURACY_START, 1)[1].split(ACCURACY_END, 1)[0].strip("\n")
    return None if section.startswith("Not evaluated yet") else section


def without_accuracy(card: str) -> str:
    """The card with its accuracy section emptied: what this tool wrote, whatever `--card` filled in since."""
    return replace_accuracy(card, "") if ACCURACY_START in card and ACCURACY_END in card else card
