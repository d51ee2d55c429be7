"""The server backend: lm-eval's local-completions / local-chat-completions against evals.server (transformers
generate behind an OpenAI-compatible API on 127.0.0.1) serving the trained toy."""

import json
import selectors
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from evals.compare import EvalRequest, evaluate
from evals.server import Generator, serve
from quant.errors import QuantError

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "evals" / "data" / "toy_arith" / "model"
LIMIT = 16
START_TIMEOUT_S = 180

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(name="eval-server")]


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The server's first stdout line, waiting at most `timeout` seconds."""
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if selector.select(timeout=1.0):
            return proc.stdout.readline()
        if proc.poll() is not None:
            break
    return ""


@pytest.fixture(scope="session")
def server_url(tmp_path_factory):
    # --idle-timeout: the server also stops by itself should this process die before the teardown.
    command = [sys.executable, "-m", "evals.server", str(FIXTURE), "--port", "0", "--idle-timeout", "120"]
    log = tmp_path_factory.mktemp("server") / "stderr.log"
    with open(log, "w") as stderr:  # a file, not a pipe: nobody drains a pipe while the tests run
        proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        line = read_line(proc, START_TIMEOUT_S)
        if not line.startswith("serving "):
            pytest.fail(f"server did not start: {line!r} {log.read_text()[-2000:]}")
        yield line.split(" on ")[-1].strip()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def run(baseline, candidate, out, **kw):
    settings = {"tasks": "toy_arith", "limit": LIMIT, "max_gen_toks": 24, "batch_size": 16, "concurrency": 4, **kw}
    return evaluate(EvalRequest(candidate=str(candidate), baseline=str(baseline), out=out, **settings),
                    log=lambda m: None)


def responses(out: Path, arm: str) -> list[str]:
    rows = [json.loads(line) for line in (out / "runs" / arm / "toy_arith" / "samples.jsonl").read_text().splitlines()]
    return [r["response"] for r in rows if r["filter"] == "flexible-extract"]


def test_completions_server_matches_in_process_model(server_url, tmp_path):
    with urllib.request.urlopen(f"{server_url}/models", timeout=30) as r:
        assert json.load(r)["data"][0]["id"] == FIXTURE.name  # the directory name
    report = run(FIXTURE, server_url, tmp_path)
    row = next(r for r in report["rows"] if r["primary"])["comparison"]
    assert report["candidate"]["kind"] == "server" and report["baseline"]["kind"] == "transformers"
    # evals.server does not speculate: the arm says so (and why) instead of reporting zero acceptance
    assert report["candidate"]["mtp"]["measured"] is False
    assert "neither SGLang's /get_server_info nor vLLM's /metrics" in report["candidate"]["mtp"]["why"]
    assert report["baseline"]["mtp"]["measured"] is True  # the in-process toy has its MTP layer
    assert next(r for r in report["rows"] if r["primary"])["acceptance"] is None
    assert row["candidate_accuracy"] >= 0.8
    served, local = responses(tmp_path, "candidate"), responses(tmp_path, "baseline")
    # Same weights and prompts; the in-process arm pads batches, so allow an occasional bf16 tie-break.
    assert sum(a == b for a, b in zip(served, local)) >= LIMIT - 2
    assert abs(row["difference"]) <= 2 / LIMIT


def test_chat_endpoint_answers_and_mixed_prompt_formats_are_refused(server_url, tmp_path):
    # The in-process baseline sends plain completion prompts, the chat endpoint gets messages: different prompts,
    # so pairing them must be an error, not a result.
    with pytest.raises(QuantError, match="prompt differs between baseline and candidate"):
        run(FIXTURE, f"{server_url}/chat/completions", tmp_path, endpoint="chat", server_model="toy_arith")
    chat = [json.loads(line) for line in
            (tmp_path / "runs" / "candidate" / "toy_arith" / "samples.jsonl").read_text().splitlines()]
    accuracy = sum(r["score"] for r in chat if r["filter"] == "flexible-extract") / LIMIT
    assert accuracy >= 0.8, "the few-shot turns rendered by the server must read like the completion prompt"


def test_unreachable_server_is_scored_as_failed_generations(server_url, tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    report = run(server_url, dead, tmp_path, server_model="toy_arith", max_retries=1, limit=6)
    row = next(r for r in report["rows"] if r["primary"])
    assert row["candidate_generations"] == {"generations": 6, "failed": 6, "empty": 0}
    assert row["comparison"]["candidate_accuracy"] == 0.0
    assert report["verdict"] == "fail" and report["candidate"]["failed_requests"] == 6


def test_server_routes_and_idle_shutdown():
    server = serve(Generator(model=None, tokenizer=None, name="idle-test"), idle_timeout=1.0)
    host, port = server.server_address[:2]
    with urllib.request.urlopen(f"http://{host}:{port}/v1/models", timeout=10) as r:
        assert json.load(r)["data"][0]["id"] == "idle-test"
    request = urllib.request.Request(f"http://{host}:{port}/v1/completions", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=10)
    assert err.value.code == 400
    assert server.stopped.wait(timeout=20), "the server must stop by itself when idle"
    server.server_close()
