"""The model card (`README.md`) written into every export, in the Hugging Face model-card convention.

It is rendered from the export's own records only (quant_manifest.json, config.json, the source's README front
matter), so it is deterministic: what was quantized and how, what stays BF16 and why, the exclusion list,
per-role error figures, serve commands for SGLang and vLLM, and the command that reproduces the export. The
accuracy section is a placeholder between markers that `quant eval --card` fills in.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import yaml

CARD_FILE = "README.md"
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


def _role_table(tensors: dict) -> list[str]:
    by_role: dict[str, list[dict]] = defaultdict(list)
    for rec in tensors.values():
        if rec.get("action") == "quantize":
            by_role[(rec.get("role") or "?", rec.get("scheme") or "?")].append(rec)
    lines = ["| role | scheme | modules | mean rel. MSE | worst rel. MSE | min SQNR (dB) |", "|---|---|---|---|---|---|"]
    for (role, scheme), recs in sorted(by_role.items()):
        mse = [r["rel_mse"] for r in recs if "rel_mse" in r]
        sqnr = [r["sqnr_db"] for r in recs if "sqnr_db" in r]
        lines.append(f"| {role} | {scheme} | {len(recs)} | {sum(mse) / len(mse):.3%} | {max(mse):.3%} | "
                     f"{min(sqnr):.1f} |" if mse else f"| {role} | {scheme} | {len(recs)} | | | |")
    return lines


def _kept_table(tensors: dict) -> list[str]:
    kept: dict[str, int] = defaultdict(int)
    for rec in tensors.values():
        if rec.get("action") == "copy" and len(rec.get("source_shape") or []) == 2:
            kept[rec.get("role") or "no role"] += 1
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


def render_card(manifest: dict, config: dict, source_ref: str, source_readme: str | None) -> str:
    settings, recipe = manifest["settings"], manifest["recipe"]
    scheme = settings["scheme"]
    short, words = SCHEME_WORDS.get(scheme, (scheme, scheme))
    base = _source_name(source_ref)
    # Named after the source and format, not the output directory: the card's bytes depend on the export only.
    out_name = f"{base.split('/')[-1]}-{short}"
    source_meta = _front_matter(source_readme or "")
    meta = {"base_model": base, "library_name": "transformers",
            "tags": sorted({short.lower(), "quark", "moe", "moe-quant"})}
    if source_meta.get("license"):
        meta["license"] = source_meta["license"]
    exclude = config.get("quantization_config", {}).get("exclude") or []
    aliases = [e for e in exclude if e.startswith(("model.decoder.", "model.eh_proj", "model.enorm", "model.hnorm",
                                                   "model.shared_head", "language_model.", "visual."))]
    shared_bf16 = any(r.get("role") == "shared_experts" and r.get("action") == "copy"
                      for r in manifest["tensors"].values())
    routed_q = any(r.get("role") == "routed_experts" and r.get("action") == "quantize"
                   for r in manifest["tensors"].values())
    mtp = bool(manifest.get("mtp_layers")) or any(n.startswith("mtp.") for n in manifest["tensors"])
    arch = (config.get("architectures") or ["?"])[0]
    recipe_arg = "" if recipe["name"] == "experts-only" else f" --recipe {recipe['name']}"
    scale_arg = "" if settings.get("scale_mode", "even") == "even" else f" --scale-mode {settings['scale_mode']}"
    sglang = f"python -m sglang.launch_server --model-path {out_name} --tp 8 --trust-remote-code"
    if shared_bf16 and routed_q:
        sglang += " --disable-shared-experts-fusion"
    vllm = f"vllm serve {out_name} --tensor-parallel-size 8"
    if mtp:
        sglang += (" \\\n    --speculative-algorithm EAGLE --speculative-num-steps 3 --speculative-eagle-topk 1 "
                   "--speculative-num-draft-tokens 4")
        vllm += " \\\n    --speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 1}'"
    lines = [
        "---", yaml.safe_dump(meta, sort_keys=True).strip(), "---", "",
        f"# {base} ({short})", "",
        f"`{base}` ({arch}) quantized with moe-quant {settings.get('version', '')}: {words}, scale rule "
        f"`{settings.get('scale_mode', 'even')}`, {_method_words(settings)}, in the AMD Quark checkpoint format "
        "(`quant_method: quark`) that SGLang, vLLM and transformers load.", "",
        "## Recipe", "",
        f"`{recipe['name']}`: {recipe.get('description', '')}.",
        "Roles and what they get: " + ", ".join(f"{role} → {scheme if what == 'scheme' else what}"
                                                for role, what in sorted(recipe["roles"].items())) + ".", "",
        "## What stays BF16 and why", "",
        *_kept_table(manifest["tensors"]), "",
        f"`quantization_config.exclude` lists {len(exclude)} entries: every BF16 linear under each name an engine "
        f"looks it up by{f', including {len(aliases)} engine-runtime aliases (MTP or wrapper names)' if aliases else ''}.",
        "",
        "## Quantization error per role", "",
        *_role_table(manifest["tensors"]), "",
        "Relative MSE and SQNR of each quantized weight against its source (quant_manifest.json lists every "
        "tensor with source and output sha256).", "",
        "## Serve", "",
        "SGLang:", "", "```bash", sglang, "```", "", "vLLM:", "", "```bash", vllm, "```", "",
        "Set the tensor-parallel degree for your machine; "
        + ("the MTP flags enable speculative decoding with the checkpoint's MTP layer." if mtp
           else "this model has no MTP layer.") + " Check the export against an engine first with "
        f"`quant verify-manifest {out_name}`.", "",
        "## Accuracy", "", ACCURACY_START,
        f"Not evaluated yet. `quant eval --candidate {out_name} --baseline <FP8 baseline> --card {out_name}` "
        "fills this section.", ACCURACY_END, "",
        "## Reproduce", "", "```bash",
        f"quant quantize {source_ref if base == source_ref else base} {out_name} --scheme {scheme}{recipe_arg}"
        f"{scale_arg}{_method_args(settings)}", "```", "",
    ]
    return "\n".join(lines)


def accuracy_section(report: dict, image: str | None) -> str:
    """The card's accuracy section from a `quant eval` report."""
    rows = ["| task | baseline | candidate | Δ (points) | 95% CI | verdict |", "|---|---|---|---|---|---|"]
    for row in report["rows"]:
        if not row.get("primary"):
            continue
        c = row["comparison"]
        rows.append(f"| {row['label']} ({c['n_questions']} questions) | {c['baseline_accuracy']:.1%} | "
                    f"{c['candidate_accuracy']:.1%} | {100 * c['difference']:+.1f} | "
                    f"[{100 * c['ci_low']:+.1f}, {100 * c['ci_high']:+.1f}] | {c['verdict']} |")
    text = [f"Against `{report['baseline'].get('name', 'baseline')}` (margin {report['margin_points']:g} points, "
            f"overall verdict **{report['verdict']}**):", "", *rows]
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
