"""Output for terminals and logs (issue #50 item 5): verify-manifest's and the eval's tables never cut a number or a
name, at any width; COLUMNS is honoured; a pipe or a file gets one plain record per line. Each case prints through
rich's own Console at 60 and 200 columns as a terminal, and to a file."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from eval_rows import acceptance, report, row
from evals.report.render import print_table as print_eval
from quant.terminal import Column, fits
from quant.verify.report import Finding, Report, render

LONG = "language_model.model.layers.61.block_sparse_moe.experts.255.down_proj.weight_scale"


def terminal(width: int) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, width=width, color_system=None), out


def piped() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=False), out


CONSOLES = {"terminal-60": lambda: terminal(60), "terminal-200": lambda: terminal(200), "pipe": piped}


def whole(text: str, value: str) -> bool:
    """`value` appears on one line of `text` (a table cell may pad it, never split it)."""
    return any(value in line for line in text.splitlines())


def test_fits_keeps_names_whole_and_lets_prose_wrap():
    columns = [Column("tensor"), Column("message", prose=True)]
    rows = [[LONG, "a long explanation " * 10]]
    assert fits(columns, rows, 200) and not fits(columns, rows, 60)
    assert not fits([Column("tensor")], [[LONG]], len(LONG) + 3)  # borders count
    assert fits([Column("tensor")], [[LONG]], len(LONG) + 4)


@pytest.mark.parametrize("where", sorted(CONSOLES))
def test_verify_findings_keep_every_tensor_name_whole(where):
    console, out = CONSOLES[where]()
    findings = [Finding("error", "vllm", ("0.32",), LONG, "vLLM builds it as MXFP4 and expects " * 4, "re-export it"),
                Finding("warning", "sglang", ("0.5.23",), "lm_head.input_scale", "ignored by the loader", "drop it")]
    render(Report("ckpt", ["vllm==0.32", "sglang==0.5.23"], findings), console)
    text = out.getvalue()
    assert whole(text, LONG) and whole(text, "lm_head.input_scale"), text
    assert "FAIL: 1 error(s), 1 warning(s)" in text
    if where == "pipe":
        assert "\x1b[" not in text and "│" not in text  # plain records, no colour, no box
        assert any(line.startswith("- engine: vllm / 0.32; tensor: " + LONG) for line in text.splitlines())
    if where == "terminal-200":
        assert "┃" in text  # a table where it fits
    if where == "terminal-60":  # prose wrapped at spaces to the width; only a line holding a whole name is longer
        assert all(len(line) <= 60 for line in text.splitlines() if LONG not in line), text


def _report():
    primary = row("gsm8k", baseline_accuracy=0.965, candidate_accuracy=0.99, difference=0.025, ci_low=0.006,
                  ci_high=0.057, verdict="inconclusive",
                  acceptance=acceptance(baseline_rate=0.81, candidate_rate=0.79, verdict="pass"))
    return report([primary], candidate={"name": "glm5-mxfp4-with-a-long-name"})


@pytest.mark.parametrize("where", sorted(CONSOLES))
def test_the_eval_table_never_cuts_a_figure(where):
    console, out = CONSOLES[where]()
    print_eval(_report(), console)
    text = out.getvalue()
    for figure in ("96.5", "99.0", "[+0.6, +5.7]", "inconclusive", "glm5-mxfp4-with-a-long-name", "pass"):
        assert whole(text, figure), (figure, text)
    assert "…" not in text  # rich's ellipsis: a cut cell
    if where != "terminal-200":
        assert re.search(r"^- Eval: gsm8k", text, re.M), text


def test_columns_is_honoured(monkeypatch):
    monkeypatch.setenv("COLUMNS", "73")
    assert Console(force_terminal=True).width == 73


def test_the_stream_status_and_summary_give_one_figure_in_one_unit():
    """The streamed quantize's bar said `disk 5.9e-06 GB of 200 GB` while its summary said `3.5 MB`."""
    from quant.units import decimal

    assert [decimal(n) for n in (5_900, 3_500_000, 200e9, 2.8e12, 12)] == ["5.9 kB", "3.5 MB", "200 GB", "2.8 TB",
                                                                           "12 bytes"]


def test_library_bars_are_off_in_a_pipe_unless_asked_for():
    """Off a terminal, `quant` turns tqdm's bars off before any library imports tqdm (which reads TQDM_* once, at
    its import): a bar drawn afterwards, as transformers' and lm-eval's are, writes nothing into the log. A user's
    own TQDM_DISABLE wins: set empty, it keeps them (tqdm reads any non-empty value, "0" too, as true)."""
    import os
    import subprocess
    import sys

    code = ("from quant.process import bars_off_a_terminal; bars_off_a_terminal(); "
            "from tqdm import tqdm; [None for _ in tqdm(range(3), desc='loading')]")
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    piped = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "loading" not in piped.stderr, piped.stderr
    kept = subprocess.run([sys.executable, "-c", code], env={**env, "TQDM_DISABLE": ""}, capture_output=True,
                          text=True, check=True)
    assert "loading" in kept.stderr
