"""One truth per report (issue #50 item 1): every verdict the eval shows (the terminal's tables, report.md,
report.json, the PNG's markers, the model card) comes from the same record, and an invalid or inconclusive verdict
carries its reasons wherever it is shown. Each verdict is built through the judge's own build_report (pass, fail,
inconclusive, and invalid for each cause) from rows of real paired comparisons."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
from rich.console import Console

from eval_rows import acceptance, row
from evals.judge import build_report
from evals.report.render import marker_color, markdown, print_table, table_rows, acceptance_rows
from quant.pipeline.model_card import accuracy_section

SETTINGS = {"mtp_depth": 3, "tasks": ["gsm8k"], "limit": 30, "seeds": [0], "max_gen_toks": None, "ci_level": 0.95,
            "lm_eval_version": "0.4"}
REQUEST = SimpleNamespace(margin=2.0, mtp_margin=5.0, limit=30)
SPECS = [SimpleNamespace(name="gsm8k", floor=0.0, size=1319, sampled=False)]
ARM = {"name": "arm", "source": "x", "description": "d", "notes": [], "failed_requests": 0}


def _case(name: str):
    """(the report, the causes its verdict names)."""
    ok = dict(baseline_accuracy=0.90, candidate_accuracy=0.89, ci_low=-0.015, ci_high=0.005)
    alive = dict(baseline_rate=0.80, candidate_rate=0.79)
    rows = {
        "pass": [row(**ok, verdict="pass", acceptance=acceptance(**alive, verdict="pass"))],
        "fail": [row(**ok, verdict="fail", acceptance=acceptance(**alive, verdict="pass"))],
        "inconclusive": [row(**ok, verdict="inconclusive", n_to_pass=400,
                             acceptance=acceptance(**alive, verdict="pass"))],
        # both arms scored nothing: the setup is broken (the 'collapsed' note would blame the candidate)
        "invalid-accuracy-floor": [row(baseline_accuracy=0.0, candidate_accuracy=0.0, verdict="pass",
                                       acceptance=acceptance(baseline_rate=0.0, candidate_rate=0.0, verdict="pass"))],
        # an untrained toy: answers fine, the baseline's draft dead (the MTP row said pass)
        "invalid-dead-draft": [row(**ok, verdict="pass",
                                   acceptance=acceptance(baseline_rate=0.01, candidate_rate=0.02, verdict="pass"))],
        # ROCm/ATOM#646: the candidate's accuracy collapsed, its draft still agrees
        "invalid-collapse": [row(baseline_accuracy=0.9, candidate_accuracy=0.0, verdict="fail",
                                 acceptance=acceptance(**alive, verdict="pass"))],
    }[name]
    report = build_report(REQUEST, SPECS, SETTINGS, dict(ARM, name="base"), dict(ARM, name="cand"), rows)
    return report


CASES = ["pass", "fail", "inconclusive", "invalid-accuracy-floor", "invalid-dead-draft", "invalid-collapse"]


@pytest.mark.parametrize("case", CASES)
def test_every_surface_shows_the_records_verdicts_and_reasons(case):
    report = _case(case)
    record = report.to_json()
    assert record["verdict"] == case.split("-")[0]
    row_verdicts = [r["comparison"]["verdict"] for r in record["rows"]]
    acc_verdicts = [r["acceptance"]["verdict"] for r in record["rows"] if r["acceptance"]]
    reasons = record["problems"] + record["next_steps"]
    assert bool(reasons) == (record["verdict"] in ("invalid", "inconclusive"))

    # the terminal (a pipe: one record per row), report.md and the card: the same verdicts, the same reasons
    out = io.StringIO()
    print_table(report, Console(file=out, force_terminal=False))
    terminal = out.getvalue()
    md = markdown(report)
    card = accuracy_section(record, None)
    assert [r[-1] for r in table_rows(report)] == row_verdicts
    assert [r[-1] for r in acceptance_rows(report)] == acc_verdicts
    for verdict in row_verdicts:
        assert f"verdict (margin 2 pt): {verdict}" in terminal and f"| {verdict} |" in md and f"| {verdict} |" in card
    for verdict in acc_verdicts:
        assert f"verdict (margin 5 pt): {verdict}" in terminal and f"| {verdict} |" in card
    for reason in reasons:
        assert reason in terminal and reason in md and reason in card, reason
    assert f"overall verdict **{record['verdict']}**" in card
    # the PNG's markers are coloured by the same verdicts
    assert {marker_color(v) for v in row_verdicts + acc_verdicts} <= {marker_color(v) for v in CASES_COLOURS}


CASES_COLOURS = ["pass", "fail", "inconclusive", "invalid"]


def test_a_dead_baseline_draft_is_invalid_on_the_mtp_row_too():
    record = _case("invalid-dead-draft").to_json()
    [r] = record["rows"]
    assert r["acceptance"]["verdict"] == "invalid" and "depth-1 acceptance" in r["acceptance"]["validity"]
    assert marker_color("invalid") != marker_color("pass")


def test_both_arms_at_zero_is_a_broken_setup_not_a_collapse():
    problems = _case("invalid-accuracy-floor").to_json()["problems"]
    assert not any("collapsed" in p for p in problems) and any("setup is broken" in p for p in problems)
    assert any("collapsed" in p for p in _case("invalid-collapse").to_json()["problems"])
