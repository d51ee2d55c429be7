"""`quant search --min-recovery`: the smallest pick of the front that passes `quant eval` against a baseline, by
bisection (issue #52, "Search then validate"); on the quantization-sensitive toy (tests/data/gptq_toy), whose
eval task is the toy arithmetic one (evals/data/toy_arith)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quant.commands.search_validate import WORK_MARK, decide_mtp, first_passing
from quant.search.searched import Choice, Searched
from quant.search.solver import Option
from quant.search.units import Unit

GPTQ_TOY = Path(__file__).parent / "data" / "gptq_toy"


def quant(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "TERM": "dumb", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "quant.cli", *args], capture_output=True, text=True, timeout=900,
                          env=env, cwd=cwd)


def test_bisection_finds_the_first_pass_within_log2_questions():
    for n in range(1, 70):
        for first in range(n + 1):  # first == n: nothing passes
            asked: list[int] = []
            found = first_passing(n, lambda i, asked=asked, first=first: asked.append(i) or i >= first)
            assert found == (first if first < n else None)
            assert len(asked) == len(set(asked)) <= math.ceil(math.log2(n)) + 1, (n, first, asked)
            if found is not None and found > 0:
                assert found - 1 in asked  # the next smaller pick was asked, and failed


def test_the_mtp_format_is_the_smallest_whose_acceptance_reaches_the_floor():
    main = Unit("layer 0 attention", ("a",), False, False)
    mtp = Unit("mtp layer 1", ("m",), True, True)
    menu = [Option("scheme", 10, 0.0), Option("mxfp8", 20, 0.0), Option("bf16", 40, 0.0)]
    searched = Searched(0, [Choice(main, [Option("scheme", 5, 0.1)], {"scheme": 4}),
                            Choice(mtp, menu[:1], {"scheme": 8})], params=64, bf16_nll=1.0,
                        pinned={mtp.name: "scheme"},
                        mtp_menus={mtp.name: Choice(mtp, menu, {"scheme": 8, "mxfp8": 16, "bf16": 32})})
    acceptance = {"scheme": 0.2, "mxfp8": 0.6, "bf16": 0.7}
    judged: list[str] = []

    def judge(s: Searched, picks: tuple[int, ...], what: str) -> dict:
        label = s.choices[1].options[picks[1]].label
        judged.append(label)
        return {"acceptance": acceptance[label], "size_bytes": s.size(picks)}

    chosen, row = decide_mtp(searched, (0, 0), judge, 0.5)
    assert judged == ["scheme", "mxfp8"] and row == {"acceptance": 0.6, "size_bytes": 25}
    assert chosen.pinned == {mtp.name: "mxfp8"} and chosen.effective_bits((0, 0)) == 2.5
    assert searched.pinned == {mtp.name: "scheme"}  # the search itself is unchanged


@pytest.mark.slow
def test_a_work_dir_holding_a_users_file_is_refused(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine\n")
    out = tmp_path / "r.yaml"
    r = quant("search", str(GPTQ_TOY / "model"), "--out", str(out), "--min-recovery", "0.95", "--baseline",
              str(GPTQ_TOY / "model"), "--tasks", "toy_arith", "--work", str(work))
    assert r.returncode == 2, r.stderr
    assert "--work" in r.stderr and "not made by quant search" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt"] and not out.exists()
    # a validating flag without --min-recovery, and --min-recovery without what eval compares
    r = quant("search", str(GPTQ_TOY / "model"), "--out", str(out), "--max-size", "1MB", "--tasks", "toy_arith")
    assert r.returncode == 2 and "--tasks validates the pick: give --min-recovery" in r.stderr
    r = quant("search", str(GPTQ_TOY / "model"), "--out", str(out), "--min-recovery", "0.95")
    assert r.returncode == 2 and "--min-recovery needs --baseline BASE and --tasks T" in r.stderr


@pytest.mark.slow
def test_search_then_validate_picks_the_smallest_passing_pick(tmp_path):
    work, out = tmp_path / "work", tmp_path / "r.yaml"
    r = quant("search", str(GPTQ_TOY / "model"), "--out", str(out), "--engine", "vllm", "--json",
              "--calib-data", str(GPTQ_TOY / "calib.jsonl"), "--calib-samples", "16",
              "--min-recovery", "0.95", "--baseline", str(GPTQ_TOY / "model"), "--tasks", "toy_arith",
              "--limit", "80", "--margin", "5", "--max-gen-toks", "24", "--batch-size", "40",
              "--min-acceptance", "0.05", "--work", str(work))
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout)
    evaluated, chosen = result["evaluated"], result["chosen"]
    assert chosen["passed"] and chosen["verdict"] == "pass" and chosen["recovery"]["toy_arith"]["ratio"] >= 0.95
    on_front = [row for row in evaluated if row["front_index"] is not None]
    assert len(on_front) <= math.ceil(math.log2(result["front_size"])) + 1
    assert len(evaluated) == len(on_front)  # the draft of the smallest MTP format already reached 0.05
    smaller = [row for row in on_front if row["front_index"] < chosen["front_index"]]
    assert chosen["front_index"] == 0 or (smaller and not max(smaller, key=lambda x: x["front_index"])["passed"]
                                          and max(x["front_index"] for x in smaller) == chosen["front_index"] - 1)
    assert all(not row["passed"] for row in smaller) and chosen["acceptance"] >= 0.05
    # the recipe written is the chosen export's, and every tried pick is in --work beside the work mark
    assert out.read_text() == Path(chosen["export"] + ".yaml").read_text()
    assert (work / WORK_MARK).is_file() and all(Path(row["report"]).is_file() for row in evaluated)
    assert json.loads(Path(chosen["report"]).read_text())["verdict"] == "pass"
