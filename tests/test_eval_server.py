"""The server backend: lm-eval's local-completions / local-chat-completions against evals.arms.model_server (transformers
generate behind an OpenAI-compatible API on 127.0.0.1) serving the trained toy."""

import json
import selectors
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from evals.compare import EvalRequest, evaluate
from evals.arms.model_server import Generator, serve
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
    command = [sys.executable, "-m", "evals.arms.model_server", str(FIXTURE), "--port", "0", "--idle-timeout", "120"]
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
                    log=lambda m: None).to_json()


def responses(out: Path, arm: str) -> list[str]:
    rows = [json.loads(line) for line in (out / "runs" / arm / "toy_arith" / "samples.jsonl").read_text().splitlines()]
    return [r["response"] for r in rows if r["filter"] == "flexible-extract"]


def test_completions_server_matches_in_process_model(server_url, tmp_path):
    with urllib.request.urlopen(f"{server_url}/models", timeout=30) as r:
        assert json.load(r)["data"][0]["id"] == FIXTURE.name  # the directory name
    report = run(FIXTURE, server_url, tmp_path)
    row = next(r for r in report["rows"] if r["primary"])["comparison"]
    assert report["candidate"]["kind"] == "server" and report["baseline"]["kind"] == "transformers"
    # evals.arms.model_server does not speculate: the arm says so (and why) instead of reporting zero acceptance
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
        run(FIXTURE, f"{server_url}/chat/completions", tmp_path, endpoint="chat", server_model=FIXTURE.name)
    chat = [json.loads(line) for line in
            (tmp_path / "runs" / "candidate" / "toy_arith" / "samples.jsonl").read_text().splitlines()]
    accuracy = sum(r["score"] for r in chat if r["filter"] == "flexible-extract") / LIMIT
    assert accuracy >= 0.8, "the few-shot turns rendered by the server must read like the completion prompt"


class FaultyServer:
    """An OpenAI-compatible front of the real toy server that breaks some of its completions the ways servers
    break in the field: HTTP 500, an HTML or non-UTF-8 body, truncated JSON, zero or two choices per prompt.
    `every`: break one request in `every` (1: all); /v1/models is always answered."""

    def __init__(self, upstream: str, fault: str, every: int = 1):
        import http.server
        import threading

        self.upstream, self.fault, self.every, self.count = upstream, fault, every, 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, body: bytes, kind="application/json"):
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                with urllib.request.urlopen(outer.upstream + "/models", timeout=30) as r:
                    self._send(200, r.read())

            def do_POST(self):
                data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.count += 1
                request = urllib.request.Request(outer.upstream + "/completions", data=data, method="POST",
                                                 headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=300) as r:
                    body = r.read()
                if outer.count % outer.every:
                    return self._send(200, body)
                answer = json.loads(body)
                if outer.fault == "500":
                    return self._send(500, b'{"error": "internal"}')
                if outer.fault == "html":
                    return self._send(200, b"<html><body>502 Bad Gateway</body></html>", "text/html")
                if outer.fault == "non-utf8":
                    return self._send(200, b"\xff\xfe\x00garbage")
                if outer.fault == "truncated":
                    return self._send(200, body[: len(body) // 2])
                if outer.fault == "zero-choices":
                    answer["choices"] = []
                if outer.fault == "two-choices":
                    answer["choices"] = answer["choices"] * 2
                return self._send(200, json.dumps(answer).encode())

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("fault", ["500", "html", "non-utf8", "truncated", "zero-choices", "two-choices"])
def test_a_broken_baseline_server_is_an_error_never_a_pass(server_url, tmp_path, fault):
    """A baseline that fails its requests would make any candidate look good; the run is an error (exit 69)
    naming the arm, and no report that looks finished is written."""
    from quant.errors import EvidenceMissing

    broken = FaultyServer(server_url, fault)
    try:
        with pytest.raises(EvidenceMissing, match=r"baseline .*: \d+ of 6 requests failed"):
            run(broken.url, FIXTURE, tmp_path, server_model=FIXTURE.name, max_retries=1, limit=6, concurrency=1,
                batch_size=1)
    finally:
        broken.close()
    assert not (tmp_path / "report.json").exists()


def test_a_candidate_server_failing_some_requests_is_an_error_not_a_fail(server_url, tmp_path):
    """8 of 20 requests failing (every other one here) is an infrastructure error (exit 69), not a regression."""
    from quant.errors import EvidenceMissing

    flaky = FaultyServer(server_url, "500", every=2)
    try:
        with pytest.raises(EvidenceMissing, match=r"candidate .*: \d+ of 8 requests failed"):
            run(FIXTURE, flaky.url, tmp_path, server_model=FIXTURE.name, max_retries=1, limit=8, concurrency=1,
                batch_size=1)
    finally:
        flaky.close()
    assert not (tmp_path / "report.json").exists()


def test_a_server_naming_another_model_is_refused_before_any_work(server_url, tmp_path):
    with pytest.raises(QuantError, match="not --server-model other-model"):
        run(FIXTURE, server_url, tmp_path, server_model="other-model")
    assert not (tmp_path / "runs").exists()


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
