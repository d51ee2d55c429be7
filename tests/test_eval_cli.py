"""`quant eval` on the command line: options reach the stage, bad input is one `error:` line."""

import os
import subprocess
import sys

import pytest
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def quant(*args):
    env = {**os.environ, "COLUMNS": "200", "TERM": "dumb"}  # help text unwrapped, whatever the terminal
    return subprocess.run([sys.executable, "-m", "quant.cli", *args], capture_output=True, text=True, timeout=300,
                          env=env)


def test_help_lists_the_options():
    result = quant("eval", "--help")
    assert result.returncode == 0
    for option in ("--candidate", "--baseline", "--tasks", "--limit", "--seeds", "--margin", "--gpqa-csv",
                   "--data-dir", "--endpoint", "--concurrency", "--max-retries", "--max-gen-toks"):
        assert option in result.stdout


def test_bad_input_is_one_error_line(tmp_path):
    result = quant("eval", "--candidate", str(tmp_path / "missing"), "--baseline", "http://127.0.0.1:9/v1",
                   "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: --candidate {tmp_path / 'missing'}: not a checkpoint directory or an http(s):// server URL"]
    result = quant("eval", "--candidate", "http://127.0.0.1:9/v1", "--baseline", "http://127.0.0.1:10/v1",
                   "--margin", "0", "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and "error: --margin 0: must be a number of points in (0, 50]" in result.stderr
    assert not (tmp_path / "out" / "report.json").exists()


@pytest.mark.slow  # the slow tier (make test-slow)
def test_bad_numbers_and_devices_are_refused_before_any_work(tmp_path):
    base = ["eval", "--candidate", "http://127.0.0.1:9/v1", "--baseline", "http://127.0.0.1:10/v1",
            "--out", str(tmp_path / "out")]
    for extra, message in ((["--margin", "nan"], "error: --margin nan: must be a number of points in (0, 50]"),
                           (["--margin", "1000"], "error: --margin 1000: must be a number of points in (0, 50]"),
                           (["--limit", "-1"], "error: --limit -1: must be positive"),
                           (["--seeds", "0"], "error: --seeds 0: must be at least 1"),
                           (["--tasks", "gsm9k"], "error: unknown task 'gsm9k'"),
                           (["--concurrency", "0"], "error: --concurrency 0: must be at least 1"),
                           (["--timeout", "0"], "error: --timeout 0: must be at least 1"),
                           (["--batch-size", "0"], "error: --batch-size 0: must be at least 1"),
                           (["--dtype", "float8"], "error: --dtype 'float8': choose from"),
                           (["--max-gen-toks", "-5"], "error: --max-gen-toks -5: must be a positive number of tokens"),
                           (["--device", "tpu9"], "error: --device 'tpu9': not a torch device"),
                           (["--top-p", "1.5"], "error: --top-p 1.5: out of range")):
        result = quant(*base, *extra)
        assert result.returncode == 2, (extra, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr, (extra, result.stderr)
    assert not (tmp_path / "out").exists()


def test_a_broken_candidate_is_found_before_the_baseline_runs(tmp_path):
    import json
    import shutil
    from pathlib import Path

    broken = tmp_path / "cand"
    shutil.copytree(Path(__file__).parent.parent / "evals" / "data" / "toy_arith" / "model", broken)
    config = json.loads((broken / "config.json").read_text())
    config["num_hidden_layers"] = "two"
    (broken / "config.json").write_text(json.dumps(config))
    result = quant("eval", "--candidate", str(broken), "--baseline", "http://127.0.0.1:9/v1", "--tasks",
                   "toy_arith", "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "'num_hidden_layers' must be an integer" in result.stderr
    assert not (tmp_path / "out").exists()


def test_unreachable_servers_and_self_comparisons_are_refused_before_any_work(tmp_path):
    """A dead URL is found before the baseline arm runs (exit 2, one line); a model compared with itself too."""
    out = tmp_path / "out"
    result = quant("eval", "--candidate", "http://127.0.0.1:9/v1", "--baseline", "http://127.0.0.1:10/v1",
                   "--tasks", "toy_arith", "--out", str(out))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "http://127.0.0.1:9/v1/models: not an OpenAI-compatible server" in result.stderr
    assert not out.exists()
    toy = str(__import__("pathlib").Path(__file__).parent.parent / "evals" / "data" / "toy_arith" / "model")
    result = quant("eval", "--candidate", toy, "--baseline", toy + "/", "--tasks", "toy_arith", "--out", str(out))
    assert result.returncode == 2 and "the same model" in result.stderr, result.stderr
    assert not out.exists()


def test_a_byte_identical_copy_of_the_candidate_is_refused_as_the_same_model(tmp_path):
    """The same model under another path (a copy, byte for byte) is a comparison with itself too: exit 2, one
    line, nothing written; one more file in the copy makes it another checkpoint."""
    import shutil
    from pathlib import Path

    toy = Path(__file__).parent.parent / "evals" / "data" / "toy_arith" / "model"
    copy = shutil.copytree(toy, tmp_path / "copy")
    out = tmp_path / "out"
    result = quant("eval", "--candidate", str(toy), "--baseline", str(copy), "--tasks", "toy_arith", "--out", str(out))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: --candidate {toy} and --baseline {copy} are the same model (byte-identical "
                               f"checkpoints, sha256 "), lines
    assert not out.exists()


@pytest.mark.slow
def test_json_prints_the_report_on_stdout(tmp_path):
    """Issue #50 item 6: `quant eval --json`, as `verify-manifest --json`: stdout is report.json, the rest stderr."""
    import json as json_module

    from quant.pipeline import quantize_checkpoint

    toy = REPO / "evals" / "data" / "toy_arith" / "model"
    quantize_checkpoint(toy, tmp_path / "mx", check_engines=[], log=lambda m: None)
    run = subprocess.run([sys.executable, "-m", "quant", "eval", "--candidate", str(tmp_path / "mx"), "--baseline",
                          str(toy), "--tasks", "toy_arith", "--limit", "4", "--no-mtp", "--out", str(tmp_path / "o"),
                          "--json"], capture_output=True, text=True, timeout=900, cwd=REPO)
    assert run.returncode in (0, 3), run.stderr[-2000:]
    assert json_module.loads(run.stdout) == json_module.loads((tmp_path / "o" / "report.json").read_text())
    assert "verdict (margin" in run.stderr
    # a log, not a terminal (issue #50 item 5): no bar joined with \r, none of lm-eval's warnings about our choices,
    # and the eval's own count and time per run
    assert "\r" not in run.stderr and "do not launch via accelerate" not in run.stderr
    assert "Ensure 'do_sample=True'" not in run.stderr and "4 questions answered (1 of 1 runs" in run.stderr
