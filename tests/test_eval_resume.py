"""Resume (issue #33 item 1): every answer is kept as it arrives (evals/arms/answers.py), so `quant eval` killed
partway and run again asks only what is missing and writes the report.json of an uninterrupted run, byte for
byte; a changed model, prompt (few-shot) or generation setting reuses nothing.

Against the real in-process backend on the trained toy and against evals.arms.model_server's Generator served
on 127.0.0.1, whose answers are counted per prompt."""

import collections
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from evals.arms.answers import answers_path, checkpoint_digest, request_key
from evals.compare import EvalRequest, evaluate
from evals.out_dir import SCRATCH_DIR

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "evals" / "data" / "toy_arith" / "model"
TOY_DATA = REPO / "evals" / "data" / "toy_arith"
QUANT = Path(sys.executable).parent / "quant"
MAX_GEN_TOKS = 24

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(name="eval-resume")]


def twin(dst: Path) -> Path:
    """The toy's weights under another checkpoint: a byte-identical copy would be the same model (refused as a
    comparison with itself), so the copy carries one more file, which no loader reads."""
    shutil.copytree(FIXTURE, dst)
    (dst / "README.md").write_text("the toy's weights, another checkpoint\n")
    return dst


def rows(out: Path, arm: str) -> int:
    path = answers_path(out / SCRATCH_DIR, arm)
    if not path.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1) as db:
            return db.execute("SELECT COUNT(*) FROM answers").fetchone()[0]
    except sqlite3.OperationalError:  # the table is not created yet
        return 0


def cli(baseline, candidate, out: Path, limit: int, **flags) -> list[str]:
    args = [str(QUANT), "eval", "--baseline", str(baseline), "--candidate", str(candidate), "--tasks", "toy_arith",
            "--limit", str(limit), "--out", str(out)]
    for flag, value in {"max_gen_toks": MAX_GEN_TOKS, **flags}.items():
        args += [f"--{flag.replace('_', '-')}", str(value)]
    return args


def run_cli(args: list[str]) -> str:
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode in (0, 1, 3), done.stderr[-3000:]
    return done.stderr


def kill_when(args: list[str], ready, timeout: float = 600) -> None:
    """Start `args` and SIGKILL it as soon as `ready()` holds."""
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    try:
        while not ready():
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "the run never got there"
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


def kept_and_asked(log: str, arm: str) -> tuple[int, int | None]:
    """(kept, asked) from the run's `ARM: K answers kept from an earlier run, M asked` line; (0, None) when the
    arm reused nothing (the line is only printed when something was kept)."""
    lines = [line for line in log.splitlines() if line.startswith(f"{arm}: ") and "kept from an earlier run" in line]
    if not lines:
        return 0, None
    (line,) = lines
    return int(line.split(": ")[1].split()[0]), int(line.split(", ")[-1].split()[0])


# ------------------------------------------------------------------------------------------------- the keys


def test_keys_change_with_model_prompt_settings_and_seed():
    base = request_key("id", "generate_until", ("Q: 1+1=", {"until": ["\n"], "max_gen_toks": 24}), 0)
    assert base == request_key("id", "generate_until", ("Q: 1+1=", {"max_gen_toks": 24, "until": ["\n"]}), 0)
    for changed in (request_key("other id", "generate_until", ("Q: 1+1=", {"until": ["\n"], "max_gen_toks": 24}), 0),
                    request_key("id", "generate_until", ("Q: 1+2=", {"until": ["\n"], "max_gen_toks": 24}), 0),
                    request_key("id", "generate_until", ("Q: 1+1=", {"until": ["\n"], "max_gen_toks": 25}), 0),
                    request_key("id", "generate_until", ("Q: 1+1=", {"until": ["\n\n"], "max_gen_toks": 24}), 0),
                    request_key("id", "generate_until", ("Q: 1+1=", {"until": ["\n"], "max_gen_toks": 24,
                                                                     "seed": 1}), 0),
                    request_key("id", "generate_until", ("Q: 1+1=", {"until": ["\n"], "max_gen_toks": 24}), 1)):
        assert changed != base


def test_checkpoint_digest_follows_config_and_weights(tmp_path):
    copy = shutil.copytree(FIXTURE, tmp_path / "copy")
    digest = checkpoint_digest(copy)
    assert checkpoint_digest(copy) == digest == checkpoint_digest(FIXTURE)  # copied with its modification times
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert checkpoint_digest(copy) != digest
    digest = checkpoint_digest(copy)
    shard = next(copy.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # one weight bit, header and size unchanged
    shard.write_bytes(bytes(data))
    assert checkpoint_digest(copy) != digest


# ----------------------------------------------------------------------------------------------- in process


def test_in_process_run_killed_and_rerun_asks_only_what_is_missing(tmp_path):
    limit, batch = 24, 8
    candidate = twin(tmp_path / "candidate")
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run_cli(cli(FIXTURE, candidate, whole, limit, batch_size=batch))
    args = cli(FIXTURE, candidate, resumed, limit, batch_size=batch)
    kill_when(args, lambda: rows(resumed, "candidate") >= batch)
    kept = rows(resumed, "candidate")
    # Committed a whole batch at a time: the rest is batched (padded) exactly as the uninterrupted run batched it.
    assert 0 < kept < limit and kept % batch == 0
    assert rows(resumed, "baseline") == limit
    assert not (resumed / "report.json").exists()
    log = run_cli(args)
    assert kept_and_asked(log, "baseline") == (limit, 0)
    assert kept_and_asked(log, "candidate") == (kept, limit - kept)
    assert (resumed / "report.json").read_bytes() == (whole / "report.json").read_bytes()
    for arm in ("baseline", "candidate"):
        path = Path("runs") / arm / "toy_arith" / "samples.jsonl"
        assert (resumed / path).read_bytes() == (whole / path).read_bytes()


def test_in_process_changes_reuse_nothing(tmp_path):
    limit, batch = 8, 8
    out = tmp_path / "out"
    candidate = twin(tmp_path / "candidate")

    def run(model=candidate, **kw):
        lines = []
        settings = {"tasks": "toy_arith", "limit": limit, "max_gen_toks": MAX_GEN_TOKS, "batch_size": batch,
                    "mtp": False, **kw}
        evaluate(EvalRequest(candidate=str(model), baseline=str(FIXTURE), out=out, **settings), log=lines.append)
        text = "\n".join(lines)
        return kept_and_asked(text, "baseline")[0], kept_and_asked(text, "candidate")[0]

    assert run() == (0, 0)
    assert run() == (limit, limit)
    assert run(max_gen_toks=MAX_GEN_TOKS - 1) == (0, 0)       # a generation setting
    assert run(dtype="float32") == (0, 0)                     # the in-process compute
    fewshot = shutil.copytree(TOY_DATA, tmp_path / "toy", ignore=shutil.ignore_patterns("model"))
    train = (fewshot / "train.jsonl").read_text().splitlines()
    (fewshot / "train.jsonl").write_text("\n".join(reversed(train)) + "\n")  # other few-shot examples
    assert run(toy_data_dir=fewshot) == (0, 0)
    changed = shutil.copytree(FIXTURE, tmp_path / "changed")
    config = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**config, "rms_norm_eps": config["rms_norm_eps"] * 2}))
    assert run(model=changed) == (limit, 0)               # another model: only the baseline's are reused
    assert run(resume=False) == (0, 0)


# -------------------------------------------------------------------------------------------------- servers


class CountingGenerator:
    """evals.arms.model_server's Generator with every answer counted per prompt; `hold_after(n)` makes requests
    after the n-th answer wait, then fail, until `release()`."""

    def __init__(self, generator):
        self.generator, self.answered = generator, collections.Counter()
        self.limit, self.gate, self.started = None, threading.Event(), 0
        self.lock = threading.Lock()
        self.name, self.digest = generator.name, generator.digest
        self.render_chat = generator.render_chat

    def hold_after(self, n: int) -> None:
        self.limit, self.gate, self.started = n, threading.Event(), 0

    def release(self) -> None:
        self.gate.set()

    def complete(self, prompt, **kw):
        with self.lock:  # counted as the request starts: exactly `limit` are answered, however many run at once
            held = self.limit is not None and self.started >= self.limit
            self.started += not held
        if held:
            self.gate.wait(timeout=600)
            raise ValueError("held by the test")  # the answer never arrives (400)
        text = self.generator.complete(prompt, **kw)
        with self.lock:
            self.answered[prompt] += 1
        return text


@pytest.fixture(scope="module")
def servers():
    from evals.arms.backends import load_checkpoint_model
    from evals.arms.model_server import Generator, serve

    model, tokenizer, _, _ = load_checkpoint_model(FIXTURE, Path("."), dtype="bfloat16", device="cpu")
    digest = checkpoint_digest(FIXTURE)
    arms = {}
    for arm in ("baseline", "candidate"):
        generator = CountingGenerator(Generator(model, tokenizer, f"toy-{arm}", digest))
        server = serve(generator)
        server.handle_error = lambda *args: None  # the killed client's closed connections are expected here
        arms[arm] = (generator, f"http://127.0.0.1:{server.server_address[1]}/v1", server)
    yield arms
    for _, _, server in arms.values():
        server.shutdown()
        server.server_close()


def test_server_run_killed_twice_and_rerun_asks_no_question_twice(servers, tmp_path):
    limit = 16
    (baseline, base_url, _), (candidate, cand_url, _) = servers["baseline"], servers["candidate"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run_cli(cli(base_url, cand_url, whole, limit, concurrency=4))
    assert set(baseline.answered.values()) == {1} and len(candidate.answered) == limit
    baseline.answered.clear()
    candidate.answered.clear()
    args = cli(base_url, cand_url, resumed, limit, concurrency=4)

    def interrupt(generator, arm: str, after: int) -> None:
        """Run the command and SIGKILL it once the arm has kept `after` answers (the server holds the rest)."""
        generator.hold_after(after)
        try:
            kill_when(args, lambda: rows(resumed, arm) >= after)
        finally:
            generator.release()
        time.sleep(0.5)  # the held requests fail without an answer
        generator.limit = None
        assert rows(resumed, arm) == after and not (resumed / "report.json").exists()

    interrupt(baseline, "baseline", 5)       # killed in the baseline arm
    assert rows(resumed, "candidate") == 0
    interrupt(candidate, "candidate", 6)     # resumed, then killed in the candidate arm
    assert sum(baseline.answered.values()) == limit
    log = run_cli(args)
    assert kept_and_asked(log, "baseline") == (limit, 0)
    assert kept_and_asked(log, "candidate") == (6, limit - 6)
    # Counted at the servers: over the three runs every question was answered once in each arm.
    assert set(baseline.answered.values()) == {1} and len(baseline.answered) == limit
    assert set(candidate.answered.values()) == {1} and len(candidate.answered) == limit
    assert (resumed / "report.json").read_bytes() == (whole / "report.json").read_bytes()


def test_server_model_or_setting_changes_reuse_nothing(servers, tmp_path):
    limit = 6
    (baseline, base_url, _), (candidate, cand_url, _) = servers["baseline"], servers["candidate"]
    out = tmp_path / "out"
    run_cli(cli(base_url, cand_url, out, limit, concurrency=2))
    log = run_cli(cli(base_url, cand_url, out, limit, concurrency=2, max_gen_toks=MAX_GEN_TOKS + 1))
    assert kept_and_asked(log, "baseline") == (0, None) and kept_and_asked(log, "candidate") == (0, None)
    candidate.digest = "0" * 64  # the same id and URL, another checkpoint behind it (its /v1/models says so)
    try:
        log = run_cli(cli(base_url, cand_url, out, limit, concurrency=2))
    finally:
        candidate.digest = candidate.generator.digest
    assert kept_and_asked(log, "baseline") == (limit, 0) and kept_and_asked(log, "candidate") == (0, None)


def test_sglang_acceptance_replays_are_kept_like_answers(tmp_path):
    """SGLang's acceptance comes from a /generate replay of each greedy generation: a resumed run replays only the
    generations whose replay was not kept, and reports what a run replaying everything reports."""
    from http.server import ThreadingHTTPServer

    from evals.arms.answers import AnswerStore
    from evals.arms.backends import BackendOptions
    from evals.arms.lm_eval_run import RunSettings
    from evals.arms.server_metrics import probe
    from evals.tasks.registry import parse_tasks
    from evals.replay import server_mtp
    from test_server_spec import _Handler

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        spec = probe(f"http://127.0.0.1:{server.server_address[1]}/v1")
        records = [{"task": "toy_arith", "seed": 0, "doc_id": i, "prompt": "Q" * (10 + i), "until": ["Q:"]}
                   for i in range(5)]
        args = (parse_tasks("toy_arith"), RunSettings(limit=None, max_gen_toks=24, seeds=1), BackendOptions(),
                lambda m: None)
        identity = {"kind": "server", "model": "m"}
        _Handler.requests.clear()
        whole = server_mtp(spec, [dict(r) for r in records], *args, AnswerStore(tmp_path / "a.sqlite", identity))
        assert len(_Handler.requests) == 5
        _Handler.requests.clear()
        store = AnswerStore(tmp_path / "b.sqlite", identity)
        server_mtp(spec, [dict(r) for r in records[:3]], *args, store)  # the run killed after 3 replays
        resumed = server_mtp(spec, [dict(r) for r in records], *args, AnswerStore(tmp_path / "b.sqlite", identity))
        assert [len(r["text"]) for r in _Handler.requests] == [10, 11, 12, 13, 14]  # each replayed once
        assert resumed == whole
        other = AnswerStore(tmp_path / "b.sqlite", {**identity, "model": "another"})
        server_mtp(spec, [dict(r) for r in records], *args, other)
        assert len(_Handler.requests) == 10  # another model's replays are its own
    finally:
        server.shutdown()


def test_a_damaged_store_is_started_afresh(tmp_path):
    from evals.arms.answers import open_store
    from evals.arms.backends import Backend, BackendOptions

    backend = Backend(label="candidate", source="http://127.0.0.1:9/v1", kind="server", lm=None)
    path = answers_path(tmp_path, "candidate")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a database" * 100)
    store = open_store(tmp_path, backend, BackendOptions())
    assert store.count() == 0
    store.put("k", "answer")
    store.close()
    assert open_store(tmp_path, backend, BackendOptions()).get("k") == "answer"


def test_in_process_sampled_generations_resume_to_the_same_samples(tmp_path):
    """GPQA's sampled generations in process: a batch draws from a seed of its own (the run's seed and its
    prompts), so the batches asked after an interruption sample what an uninterrupted run samples. The
    interruption is emulated by dropping every kept answer after each arm's first batch (as a kill then leaves
    it: whole batches, in the order they were asked)."""
    from test_eval_tasks import write_gpqa_csv

    csv_path = write_gpqa_csv(tmp_path / "gpqa.csv", n=6)
    other = twin(tmp_path / "twin")

    def run(out):
        lines = []
        evaluate(EvalRequest(candidate=str(other), baseline=str(FIXTURE), out=out, tasks="gpqa_diamond", limit=None,
                             seeds=2, gpqa_csv=csv_path, max_gen_toks=12, batch_size=2, mtp=False),
                 log=lines.append)
        return "\n".join(lines)

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run(whole)
    run(resumed)
    for arm in ("baseline", "candidate"):
        with sqlite3.connect(answers_path(resumed / SCRATCH_DIR, arm)) as db:
            db.execute("DELETE FROM answers WHERE rowid > 2")
    log = run(resumed)
    assert kept_and_asked(log, "baseline") == (2, 10) and kept_and_asked(log, "candidate") == (2, 10)
    assert (resumed / "report.json").read_bytes() == (whole / "report.json").read_bytes()
    for seed in (0, 1):
        path = Path("runs") / "candidate" / f"gpqa_diamond-seed{seed}" / "samples.jsonl"
        assert (resumed / path).read_bytes() == (whole / path).read_bytes()
