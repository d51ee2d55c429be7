"""The eval stage end to end: validate the request (evals.request), claim --out (evals.out_dir), run both arms
(evals.run_arms, their MTP acceptance by evals.replay), pair the answers into the verdict and the gate
(evals.judge) and write the report (evals.report). Data flows one way; report.json is written last."""

from __future__ import annotations

import os
import sys

from evals.arms.answers import digests_for_this_run
from evals.arms.lm_eval_run import quiet_third_parties
from evals.judge import (
    EXIT_CODES,
    apply_request_gate,
    build_report,
    compare_records,
    read_request_gate,
    write_baseline_gate,
)
from evals.out_dir import RUNS_DIR, SCRATCH_DIR, check_gate_target, check_not_itself, claim_out, prepare_out
from evals.report.render import write_report
from evals.request import EvalRequest, check, check_chat, check_inputs, run_settings
from evals.run_arms import load_baseline_run, run_arms
from evals.statistics.results import EvalReport
from evals.tasks.registry import parse_tasks
from quant.errors import QuantError, machine_failure, naming

__all__ = ["EXIT_CODES", "EvalRequest", "evaluate"]


def evaluate(request: EvalRequest, log=print) -> EvalReport:
    """Run the comparison and write the report; returns the report (`report.verdict`; `report.to_json()` is what
    report.json holds)."""


    quiet_third_parties(sys.stderr.isatty())  # lm-eval's warnings about our own choices; bars only on a terminal
    with digests_for_this_run():  # each checkpoint hashed once in this run (the check below, then its arm)
        return _evaluate_checked(request, log)


def _evaluate_checked(request: EvalRequest, log) -> EvalReport:
    check(request)
    specs = parse_tasks(request.tasks)
    check_chat(request, specs)
    settings = run_settings(request, specs)
    earlier = load_baseline_run(request.baseline_run, specs, settings) if request.baseline_run else None
    if request.write_gate is not None:  # a new file outside every input, or --overwrite
        check_gate_target(request)
    gate = read_request_gate(request, specs)
    owner = claim_out(request)
    owner.check()  # a foreign --out, or an input inside it, is refused before the servers are asked
    check_inputs(request, specs)
    with owner as held:
        # Under --out's lock (a second eval into it is refused first), before anything in it is removed; a refusal
        # leaves a new --out as it found it (not there).
        check_not_itself(request, earlier)
        prepare_out(held, request.resume)
        try:
            report = _evaluate(request, specs, settings, earlier, held, log, gate)
        except Exception as e:  # a full or read-only disk met inside lm-eval or datasets: exit 74 naming OUT
            failure = machine_failure(e)
            if failure is None or isinstance(e, QuantError):
                raise
            raise naming(failure, held.root) from e
    if request.write_gate is not None:
        write_baseline_gate(request, specs, report)
    return report


def _evaluate(request: EvalRequest, specs, settings: dict, earlier, held, log, gate=None) -> EvalReport:
    out, scratch = held.root, held.root / SCRATCH_DIR
    scratch.mkdir(exist_ok=True)
    baseline_arm, baseline, candidate_arm, candidate = run_arms(request, specs, earlier, scratch, log)
    os.replace(scratch / RUNS_DIR, out / RUNS_DIR)  # no runs/ stands there: refused or removed on entry
    held.add([RUNS_DIR])  # both arms' samples, in place (and ours) before they are paired
    report = build_report(request, specs, settings, baseline_arm, candidate_arm,
                          compare_records(baseline, candidate, specs, request))
    if gate is not None:
        apply_request_gate(report, gate)
    write_report(report, out, record=held.add)
    return report
