"""`quant eval --candidate CKPT_OR_URL --baseline CKPT_OR_URL`: is the candidate as accurate as the baseline?

Runs the eval tasks (--tasks: lm-eval tasks recorded under evals/tasks/records, their data from the hub through
`datasets` or from local files) on both models, pairs the answers question by question and decides
non-inferiority against a margin; where both arms have an MTP draft, its acceptance too (its own margin). Exit
code: 0 pass, 1 fail, 3 inconclusive, 4 invalid (an arm at or below its floor), 69 no verdict (an arm's requests
failed), 2 a bad argument (evals/statistics/evidence.py says why).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from evals.request import EvalRequest
from evals.tasks.registry import budgets_help, tasks_help
from quant.errors import QuantError


def _default(name: str):
    """EvalRequest holds every option's default: the command line shows and passes the same one."""
    return EvalRequest.__dataclass_fields__[name].default


def _from_records(describe) -> str:
    """A list for --help read from the task records. A broken record must not break `quant --help` or another
    command: `quant eval` itself stops on it with the file and the key."""
    try:
        return describe()
    except QuantError as e:
        return f"(the task records cannot be read: {e})"


def command(
    candidate: str = typer.Option(..., help="Candidate (e.g. MXFP4): checkpoint directory or server URL "
                                  "http://host:port/v1"),
    baseline: Optional[str] = typer.Option(_default("baseline"), help="Baseline (e.g. FP8): checkpoint directory "
                                           "or server URL"),
    baseline_run: Optional[Path] = typer.Option(_default("baseline_run"), help="Instead of --baseline: reuse the "
                                                "baseline answers of an earlier eval output directory (same tasks "
                                                "and settings)"),
    tasks: str = typer.Option(_default("tasks"), help="Comma-separated: " + _from_records(tasks_help)),
    out: Path = typer.Option(_default("out"), help="Output directory (report.json/md/png, per-question samples)"),
    limit: Optional[int] = typer.Option(_default("limit"), help="Questions per task (first N; GPQA-Diamond has "
                                        "198); 0 for all"),
    seeds: int = typer.Option(_default("seeds"), help="Generation seeds for sampled tasks (GPQA: temperature 1.0, "
                              "do_sample)"),
    margin: float = typer.Option(_default("margin"), help="Non-inferiority margin in accuracy points"),
    data_dir: Optional[Path] = typer.Option(_default("data_dir"), help="Local GSM8K directory with train.jsonl "
                                            "and test.jsonl (question/answer); default: openai/gsm8k [main] from "
                                            "the hub"),
    gpqa_csv: Optional[Path] = typer.Option(_default("gpqa_csv"), help="Local GPQA-Diamond CSV (columns Question, "
                                            "Correct Answer, Incorrect Answer 1-3); default: the gated "
                                            "Idavidrein/gpqa [gpqa_diamond] from the hub with your HF token"),
    max_gen_toks: Optional[int] = typer.Option(_default("max_gen_toks"), help="Max generated tokens (default per "
                                               "task: " + _from_records(budgets_help) + ")"),
    temperature: float = typer.Option(_default("temperature"), help="Sampling temperature of sampled tasks"),
    top_p: float = typer.Option(_default("top_p"), help="top_p of sampled tasks"),
    endpoint: str = typer.Option(_default("endpoint"), help="Server endpoint: completions | chat"),
    server_model: Optional[str] = typer.Option(_default("server_model"), help="Model name sent to servers "
                                               "(default: first of GET /v1/models)"),
    concurrency: int = typer.Option(_default("concurrency"), help="Concurrent requests per server"),
    max_retries: int = typer.Option(_default("max_retries"), help="Attempts per server request before it is "
                                    "scored as failed"),
    timeout: int = typer.Option(_default("timeout"), help="Seconds per server request"),
    batch_size: int = typer.Option(_default("batch_size"), help="In-process batch size"),
    device: Optional[str] = typer.Option(_default("device"), help="In-process torch device (default: cuda if "
                                         "available)"),
    dtype: str = typer.Option(_default("dtype"), help="In-process compute dtype: bfloat16 | float32 | float64 "
                              "(float64: the same answers on every CPU)"),
    thinking: Optional[str] = typer.Option(_default("thinking"), help="Reasoning models: on | off, the chat "
                                           "template's thinking switch (enable_thinking / thinking); reasoning is "
                                           "kept out of answer extraction. Default: the template's own"),
    activations: Optional[str] = typer.Option(_default("activations"), help="In process: emulate "
                                              "(quantize-dequantize each quantized linear's input as the scheme "
                                              "says) | bf16; default emulate where the scheme quantizes "
                                              "activations"),
    baseline_name: Optional[str] = typer.Option(_default("baseline_name"), help="Name in the report (default: "
                                                "from the weights)"),
    candidate_name: Optional[str] = typer.Option(_default("candidate_name"), help="Name in the report (default: "
                                                 "from the weights)"),
    mtp: bool = typer.Option(_default("mtp"), help="Measure MTP draft acceptance: in process from the "
                             "checkpoint's MTP layers, from servers that speculate (see README)"),
    mtp_depth: int = typer.Option(_default("mtp_depth"), help="Draft tokens per verification round for the "
                                  "in-process acceptance (the engines' speculative_num_steps)"),
    mtp_margin: float = typer.Option(_default("mtp_margin"), help="Non-inferiority margin on depth-1 draft "
                                     "acceptance, in points"),
    card: Optional[Path] = typer.Option(None, help="Export directory (written by quant quantize) whose model card "
                                        "(README.md) gets this accuracy section (replaced on every run; "
                                        "report.png is copied beside)"),
    gate: Optional[Path] = typer.Option(_default("gate"), "--gate", help="A CI gate in vLLM's GSM8K eval config "
                                        "format (accuracy_threshold, tolerance, min_acceptance_length, "
                                        "num_questions, num_fewshot): applied to the candidate; a miss is a fail "
                                        "(exit 1)"),
    write_gate: Optional[Path] = typer.Option(_default("write_gate"), "--write-gate", help="Write such a gate file "
                                              "from this run's baseline arm (its accuracy, the margin as "
                                              "tolerance, its acceptance length less the MTP margin), for a "
                                              "release's own CI"),
    resume: bool = typer.Option(_default("resume"), "--resume/--no-resume", help="Reuse the answers kept by a run "
                                "into this --out (keyed by model, prompt, settings); ask only what is missing"),
    overwrite: bool = typer.Option(_default("overwrite"), "--overwrite", help="Write --out into a directory this "
                                   "tool did not make (files it did not write are never deleted); let "
                                   "--write-gate replace a file"),
    json_output: bool = typer.Option(False, "--json", help="Print report.json on stdout (as verify-manifest --json "
                                     "does); the tables and notes go to stderr"),
) -> None:
    """Compare a candidate against a baseline on the eval tasks with paired statistics."""
    _run(dict(locals()))


def _run(options: dict) -> None:
    """The request built from the options (each EvalRequest field from the option of its name; --limit 0 means all
    questions), evaluated and shown; exits with the verdict's code."""
    from evals.compare import EXIT_CODES, evaluate

    if options["card"] is not None:
        from evals.report.card import check_card_target

        check_card_target(options["card"])

    fields = EvalRequest.__dataclass_fields__
    request = EvalRequest(**{**{k: v for k, v in options.items() if k in fields}, "limit": options["limit"] or None})
    report = evaluate(request, log=lambda m: typer.echo(m, err=True))
    _show(report, request.out, request.write_gate, options["card"], options["json_output"])
    raise typer.Exit(EXIT_CODES[report.verdict])


def _show(report, out: Path, write_gate: Optional[Path], card: Optional[Path], json_output: bool) -> None:
    """The tables, what was written and the card updated; with --json, report.json on stdout and the rest on
    stderr."""
    from rich.console import Console

    from evals.report.render import print_table

    print_table(report, Console(stderr=json_output))
    say = lambda m: typer.echo(m, err=json_output)  # noqa: E731
    say(f"wrote {out / 'report.md'}, {out / 'report.json'}, {out / 'report.png'}"
        + (f", gate {write_gate}" if write_gate else ""))
    if card is not None:
        from evals.report.card import add_accuracy

        say(f"updated {add_accuracy(card, report.to_json(), out)}")
    if json_output:
        typer.echo(json.dumps(report.to_json(), indent=1))
