"""The comparison written out: report.json (everything), report.md (the table and how to read it), report.png
(the paired differences against the margin) and the same table printed with rich."""

from __future__ import annotations

import json
import os
from pathlib import Path

from evals.statistics.recovery import Recovery
from evals.statistics.results import ComparisonRow, EvalReport
from quant.files import write_atomic
from quant.terminal import Column
from quant.terminal import print_table as print_rows

REPORT_JSON, REPORT_MD, REPORT_PNG = "report.json", "report.md", "report.png"
VERDICT_STYLE = {"pass": "green", "fail": "red", "inconclusive": "yellow", "invalid": "magenta"}

METHODS = {
    "accuracy_stderr": "lm-eval's standard error of the mean (sample sd with n-1 over sqrt(n)); for several seeds "
                       "computed over per-question seed means (clustered by question)",
    "difference": "candidate minus baseline, mean over questions of the paired per-question difference",
    "ci": "95% Tango score interval for the difference of paired proportions (Tango 1998, Stat Med 17:891-908; "
          "recommended by Newcombe 1998): the score test inverted with the nuisance cell at its constrained MLE. "
          "It does not collapse when no question is discordant (bound 3.84/(n+3.84)) and keeps near-nominal "
          "coverage at small n. With several seeds, x and y are the sums of the positive and negative parts of "
          "the per-question seed-averaged differences, so the question stays the unit",
    "n_to_pass": "the fewest questions that could pass at this margin if the observed discordance rates held "
                 "(none when the observed difference is already below -margin)",
    "mcnemar": "exact two-sided McNemar test (binomial on the discordant pairs b, c). With several seeds: the exact "
               "sign test on the per-question seed-averaged differences (b = questions where the baseline's mean "
               "is higher, c = where the candidate's is higher, ties dropped), which equals McNemar for one seed "
               "and keeps the question as the unit, so seeds are not counted as independent questions",
    "verdict": "non-inferiority against the margin: pass when the CI's lower bound > -margin (equivalently "
               "Tango's score test rejects delta <= -margin at 2.5%), fail when the "
               "whole CI is below -margin, inconclusive when the CI contains -margin. The overall verdict uses "
               "each task's primary filter (flexible-extract): fail if any fails, else inconclusive if any is",
    "mtp_acceptance": "each arm's MTP draft on that arm's own generations (in process: evals/arms/mtp_draft.py, the "
                      "engines' MTP forward; servers: the engine's own counters, README). Depth-1 acceptance = "
                      "share of generated positions where the draft's greedy token equals the target's next greedy "
                      "token; mean accepted length = tokens per verification round of a greedy speculative decode "
                      "with `mtp_depth` draft tokens (SGLang's accept length, vLLM's mean acceptance length). "
                      "Intervals: paired percentile bootstrap over questions (10,000 resamples, pooled ratios); "
                      "verdict: non-inferiority of depth-1 acceptance against the MTP margin, combined with the "
                      "accuracy verdicts. An arm without a draft is reported as not measured, never as zero",
    "recovery": "candidate accuracy ÷ baseline accuracy over the same questions, with the 95% score interval for "
                "the ratio of paired proportions (Nam & Blackwelder 2002; Tang, Tang & Chan 2003)",
    "failures": "requests that failed after all retries, and empty generations, are scored wrong and counted",
    "exit_code": "0 pass, 1 fail, 3 inconclusive, 4 invalid (an arm at or below its floor), 69 no verdict (an "
                 "arm's requests failed); errors print 'error: ...' on stderr with 2 (bad input), 70 (a bug of this "
                 "tool), 74 (the machine failed a write) or 130 (interrupted), as in the README's table",
}


def _pt(x: float, signed: bool = False) -> str:
    return f"{100 * x:+.1f}" if signed else f"{100 * x:.1f}"


def _p(p: float) -> str:
    return f"{p:.3g}" if p >= 0.001 else f"{p:.1e}"


def recovery_cell(rec: Recovery | None) -> str:
    """Candidate ÷ baseline accuracy in percent with its interval (evals/statistics/recovery.py)."""
    if not rec or rec.ratio is None:
        return "-"
    return f"{100 * rec.ratio:.1f}% [{100 * rec.ci_low:.1f}, {100 * rec.ci_high:.1f}]"


def gate_lines(report: EvalReport) -> list[str]:
    """The CI gate's checks (quant eval --gate), one line each."""
    gate = report.gate
    if not gate:
        return []
    lines = [f"CI gate on {gate['task']}" + (f" ({gate['model_name']})" if gate.get("model_name") else "")
             + (": passed" if gate["passed"] else ": MISSED (the verdict is a fail)")]
    for check in gate["checks"]:
        measured = "not measured" if check["measured"] is None else f"{check['measured']:.4g}"
        lines.append(f"- {check['check']}: {measured}, needs {check['required']:.4g} ({check['rule']}): "
                     + ("pass" if check["passed"] else "miss"))
    return lines


def table_rows(report: EvalReport) -> list[list[str]]:
    rows = []
    for r in report.rows:
        c = r.comparison
        label = f"{r.label} ({r.filter})" + ("" if r.primary else " [secondary]")
        if c.samples_per_question > 1:
            label += f", {c.samples_per_question} seeds"
        rows.append([
            label,
            str(c.n_questions),
            f"{_pt(c.baseline_accuracy)} ± {_pt(c.baseline_stderr)}",
            f"{_pt(c.candidate_accuracy)} ± {_pt(c.candidate_stderr)}",
            _pt(c.difference, signed=True),
            f"[{_pt(c.ci_low, True)}, {_pt(c.ci_high, True)}]",
            recovery_cell(r.recovery),
            f"{_p(c.mcnemar_p)} (b={c.baseline_only_correct}, c={c.candidate_only_correct})",
            "-" if c.n_to_pass is None else str(c.n_to_pass),
            c.verdict.value,
        ])
    return rows


def table_header(report: EvalReport) -> list[str]:
    return ["Eval", "n", f"{report.baseline['name']} baseline", report.candidate["name"], "Δ (pt)",
            "95% CI (pt)", "recovery [95% CI]", "McNemar p", "n to pass",
            f"verdict (margin {report.margin_points:g} pt)"]


def acceptance_rows(report: EvalReport) -> list[list[str]]:
    rows = []
    for r in report.rows:
        a = r.acceptance
        if not a:
            continue
        ci = lambda pair, signed=False: f"[{_pt(pair[0], signed)}, {_pt(pair[1], signed)}]"  # noqa: E731
        rows.append([
            r.label, str(a.n_questions),
            f"{_pt(a.baseline_rate)} {ci(a.baseline_rate_ci)}",
            f"{_pt(a.candidate_rate)} {ci(a.candidate_rate_ci)}",
            f"{_pt(a.rate_difference, True)} {ci((a.rate_ci_low, a.rate_ci_high), True)}",
            f"{a.baseline_length:.2f} → {a.candidate_length:.2f} "
            f"(Δ {a.length_difference:+.2f} [{a.length_ci[0]:+.2f}, {a.length_ci[1]:+.2f}])",
            a.verdict.value,
        ])
    return rows


def acceptance_header(report: EvalReport) -> list[str]:
    depth = report.settings.get("mtp_depth")
    return ["Eval", "n", f"{report.baseline['name']} depth-1 acc. (%)", f"{report.candidate['name']} (%)",
            "Δ (pt), 95% CI", f"mean accepted length at depth {depth}",
            f"verdict (margin {report.mtp_margin_points:g} pt)"]


def mtp_status(report: EvalReport) -> list[str]:
    """One line per arm saying what was measured, or why not."""
    lines = []
    for arm, record in (("baseline", report.baseline), ("candidate", report.candidate)):
        m = record.get("mtp") or {"measured": False, "why": "not measured"}
        lines.append(f"- {arm}: " + (m.get("source", "measured") + (f", depth {m['depth']}" if m.get("depth") else "")
                                     if m.get("measured") else f"not measured ({m.get('why')})"))
    return lines


def activation_mode(arm: dict) -> str:
    """How an arm computed its activations (evals.arms.backends: "emulate", "bf16" or "server")."""
    mode = arm.get("activations")
    if mode == "server" or arm.get("kind") == "server":
        return "as the server's kernels compute them"
    note = next((n for n in arm.get("notes") or [] if n.startswith(("activations emulated", "weights-only"))), "")
    if mode == "emulate":
        return "emulated (--activations emulate): " + note.split(": ", 1)[-1]
    return "BF16, not quantized" + (f" ({note.rsplit('(', 1)[-1]}" if note.endswith(")") else "") \
        + "; a server running the real kernels quantizes them for W4A4 schemes such as w_mxfp4_a_mxfp4"


def verdict_notes(report: EvalReport) -> list[str]:
    """Why a verdict is invalid, and what would decide an inconclusive one (evals/statistics/evidence.py)."""
    lines = []
    if report.problems:
        lines += ["Why no verdict on accuracy can be given:", ""] + [f"- {p}" for p in report.problems] + [""]
    if report.next_steps:
        lines += ["Next steps to decide:", ""] + [f"- {p}" for p in report.next_steps] + [""]
    return lines


def markdown(report: EvalReport) -> str:
    header = table_header(report)
    baseline, candidate = report.baseline, report.candidate
    lines = [
        f"# Accuracy: {candidate['name']} vs {baseline['name']}",
        "",
        f"**Verdict: {report.verdict.value.upper()}** (non-inferiority margin {report.margin_points:g} points; "
        f"exit code {report.exit_code})",
        "",
        *verdict_notes(report),
        f"- baseline: `{baseline['source']}` — {baseline['description']}"
        + (f" (answers reused from `{baseline['reused_from']}`)" if "reused_from" in baseline else ""),
        f"- candidate: `{candidate['source']}` — {candidate['description']}",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(report)]
    lines += ["", "Accuracies in percent ± 1 standard error; Δ = candidate − baseline in points; recovery = "
              "candidate ÷ baseline accuracy.", ""]
    if report.gate:
        lines += ["## CI gate", ""] + gate_lines(report) + [""]
    lines += ["## MTP draft acceptance (speculative decoding)", ""] + mtp_status(report) + [""]
    acc = acceptance_rows(report)
    if acc:
        header = acceptance_header(report)
        lines += ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in acc]
        lines += ["", "Depth-1 acceptance in percent with its 95% bootstrap interval; Δ = candidate − baseline.", ""]
    lines.append("## Generations that failed or came back empty (scored wrong)")
    lines.append("")
    lines.append("| Eval | arm | generations | failed | empty |")
    lines.append("|---|---|---|---|---|")
    for r in report.rows:
        if r.primary:
            for arm, g in (("baseline", r.baseline_generations), ("candidate", r.candidate_generations)):
                lines.append(f"| {r.label} | {arm} | {g.generations} | {g.failed} | {g.empty} |")
    emulated = any(arm["notes"] for arm in (baseline, candidate))
    lines += ["", "## Method", ""]
    lines += [f"- {key.replace('_', ' ')}: {text}" for key, text in METHODS.items()]
    if emulated:
        lines += ["", "## Approximation", "",
                  "The in-process (transformers) backend dequantizes each quantized checkpoint into BF16, so every "
                  "quantized weight holds its MXFP4/FP8 value (MXFP4 exactly; FP8 times its scale rounded to BF16). "
                  "Activations, per arm:", ""]
        lines += [f"- {label}: {activation_mode(arm)}" for label, arm in (("baseline", baseline),
                                                                          ("candidate", candidate))]
    s = report.settings
    lines += ["", "## Settings", "",
              f"- tasks: {', '.join(s['tasks'])}; limit {s['limit']}; seeds for sampled tasks {s['seeds']}; "
              f"max_gen_toks {s['max_gen_toks'] or 'task default'}"
              + (f"; thinking {s['thinking']} (chat template switch; reasoning kept out of answer extraction)"
                 if s.get("thinking") else ""),
              f"- interval: {s.get('ci_method', 'tango-score')} at {s['ci_level']:.0%}; lm-eval "
              f"{s['lm_eval_version']}",
              "- samples per arm and task: `runs/<arm>/<task>/samples.jsonl`; lm-eval results next to them", ""]
    return "\n".join(lines)


def plot(report: EvalReport, path: Path) -> None:
    """Paired difference and CI per row, with the -margin line."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report.rows
    labels = [f"{r.label}\n{r.filter}" for r in rows]
    accepted = [r for r in rows if r.acceptance]
    height = 1.0 + 0.7 * len(rows)
    if accepted:
        fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7.5, height + 1.2 + 0.7 * len(accepted)),
                                      gridspec_kw={"height_ratios": [len(rows) + 1, len(accepted) + 1]})
        _plot_acceptance(ax2, report, accepted)
    else:
        fig, ax = plt.subplots(figsize=(7.5, height))
    for i, r in enumerate(rows):
        c = r.comparison
        color = marker_color(c.verdict.value)
        d, lo, hi = (100 * x for x in (c.difference, c.ci_low, c.ci_high))
        ax.errorbar(d, i, xerr=[[d - lo], [hi - d]], fmt="o", color=color, capsize=4,
                    alpha=1.0 if r.primary else 0.5)
        ax.annotate(f"{_pt(c.baseline_accuracy)} → {_pt(c.candidate_accuracy)}  ({c.verdict.value})",
                    (hi, i), textcoords="offset points", xytext=(6, -3), fontsize=8)
    margin = report.margin_points
    ax.axvline(0, color="black", linewidth=0.8)
    ax.axvline(-margin, color="tab:red", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel(f"{report.candidate['name']} − {report.baseline['name']} accuracy (points), 95% paired CI")
    ax.set_title(f"Verdict: {report.verdict.value}  (dashed: −margin, {margin:g} pt)", fontsize=10)
    lows = [100 * r.comparison.ci_low for r in rows] + [-margin]
    highs = [100 * r.comparison.ci_high for r in rows] + [0.0]
    span = max(highs) - min(lows) or 1.0
    ax.set_xlim(min(lows) - 0.15 * span, max(highs) + 0.6 * span)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def marker_color(verdict: str) -> str:
    """The PNG's colour for a verdict: the terminal's (VERDICT_STYLE) in matplotlib's palette."""
    style = VERDICT_STYLE.get(verdict, "gray")
    return {"green": "tab:green", "red": "tab:red", "yellow": "tab:orange", "magenta": "tab:purple"}.get(style, style)


def _plot_acceptance(ax, report: EvalReport, rows: list[ComparisonRow]) -> None:
    margin = report.mtp_margin_points
    for i, r in enumerate(rows):
        a = r.acceptance
        color = marker_color(a.verdict.value)
        d, lo, hi = (100 * x for x in (a.rate_difference, a.rate_ci_low, a.rate_ci_high))
        ax.errorbar(d, i, xerr=[[d - lo], [hi - d]], fmt="s", color=color, capsize=4)
        ax.annotate(f"{_pt(a.baseline_rate)} → {_pt(a.candidate_rate)}; length {a.baseline_length:.2f} → "
                    f"{a.candidate_length:.2f}  ({a.verdict.value})", (hi, i), textcoords="offset points",
                    xytext=(6, -3), fontsize=8)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.axvline(-margin, color="tab:red", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(rows)), [f"{r.label}\nMTP acceptance" for r in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel("candidate − baseline depth-1 draft acceptance (points), 95% paired bootstrap CI")
    lows = [100 * r.acceptance.rate_ci_low for r in rows] + [-margin]
    highs = [100 * r.acceptance.rate_ci_high for r in rows] + [0.0]
    span = max(highs) - min(lows) or 1.0
    ax.set_xlim(min(lows) - 0.15 * span, max(highs) + 0.9 * span)


def print_table(report: EvalReport, console=None) -> None:
    """The comparison (and MTP acceptance) tables and the verdict's notes on `console` (default: stdout's): tables
    where they fit a terminal whole, one record per row in a pipe or a log (quant.terminal)."""
    from rich.console import Console
    from rich.markup import escape


    console = console or Console()
    verdict = len(table_header(report)) - 1
    print_rows(console, f"{report.candidate['name']} vs {report.baseline['name']} — verdict: {report.verdict.value}",
               [Column(name) for name in table_header(report)],
               [[*row[:-1], f"[{VERDICT_STYLE[row[-1]]}]{escape(row[-1])}[/]"] for row in table_rows(report)],
               markup=(verdict,))
    acc = acceptance_rows(report)
    if acc:
        last = len(acceptance_header(report)) - 1
        print_rows(console, "MTP draft acceptance", [Column(name) for name in acceptance_header(report)],
                   [[*row[:-1], f"[{VERDICT_STYLE[row[-1]]}]{escape(row[-1])}[/]"] for row in acc], markup=(last,))
    lines = ["MTP " + line[2:] for line in mtp_status(report)]
    for label, arm in (("baseline", report.baseline), ("candidate", report.candidate)):
        if arm.get("notes"):  # a quantized checkpoint run in process
            lines.append(f"activations, {label}: {activation_mode(arm)}")
    lines += [line for line in verdict_notes(report) if line] + list(gate_lines(report))
    for line in lines:
        console.print(escape(line), highlight=False, soft_wrap=not console.is_terminal)


def write_report(report: EvalReport, out_dir: Path, record=None) -> dict[str, Path]:
    """Write the PNG and markdown, then report.json last (atomically, the report's JSON form): its presence means
    the run finished. `record(names)`: the owner record's, told of each file as soon as it is written."""

    paths = {"png": out_dir / REPORT_PNG, "md": out_dir / REPORT_MD, "json": out_dir / REPORT_JSON}
    plot(report, paths["png"])
    write_atomic(paths["md"], markdown(report))
    if record is not None:
        record([REPORT_PNG, REPORT_MD])
    write_atomic(paths["json"], json.dumps(report.to_json(), indent=2) + "\n")
    if record is not None:
        record([REPORT_JSON])
    return paths
