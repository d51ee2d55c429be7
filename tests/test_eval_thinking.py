"""Reasoning-model tasks end to end (issue #33 item 3's done-when): GSM8K chat-boxed and GPQA-Diamond CoT with
`--thinking` against the project's own OpenAI-compatible server (evals.arms.model_server) serving the trained toy
with a chat template that thinks (Qwen3's switch: the generation prompt opens `<think>`, or with
enable_thinking false holds an empty `<think></think>`), and in process, where MTP acceptance is measured on the
same generations. The toy never learnt to close its thinking, so with thinking on every generation is reasoning:
the server returns it as `reasoning_content` and an empty answer, and nothing of it may be extracted or scored."""

import json
import shutil
import urllib.request
from pathlib import Path

import pytest

from evals.arms.answers import checkpoint_digest
from evals.arms.backends import load_checkpoint_model
from evals.arms.model_server import Generator, serve
from evals.compare import EvalRequest, evaluate
from quant.pipeline import quantize_checkpoint
from test_eval_tasks import write_gpqa_csv, write_gsm8k_dir

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "evals" / "data" / "toy_arith" / "model"
SHARED_GSM8K = REPO.parent / "shared" / "data" / "gsm8k"
LIMIT = 3
# Qwen3's thinking switch, over a plain user/assistant layout the toy's byte tokenizer reads.
THINKING_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<|user|>\n{{ m.content }}\n"
    "{%- elif m.role == 'assistant' -%}<|assistant|>\n{{ m.content }}\n{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>\n"
    "{%- if enable_thinking is defined and enable_thinking is false -%}<think></think>\n"
    "{%- else -%}<think>{%- endif -%}{%- endif -%}")

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(name="eval-thinking")]


class RecordingGenerator(Generator):
    """The server's real generator; it also keeps every prompt its chat template rendered."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rendered: list[str] = []

    def render_chat(self, messages, template_kwargs=None):
        prompt = super().render_chat(messages, template_kwargs)
        self.rendered.append(prompt)
        return prompt


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("thinking")
    toy = root / "toy-thinking"
    shutil.copytree(FIXTURE, toy)
    config = json.loads((toy / "tokenizer_config.json").read_text())
    (toy / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINKING_TEMPLATE}, indent=2))
    mxfp4 = root / "toy-thinking-mxfp4"
    quantize_checkpoint(toy, mxfp4, scheme="w_mxfp4_a_mxfp4", check_engines=None, log=lambda m: None)
    assert "chat_template" in json.loads((mxfp4 / "tokenizer_config.json").read_text())
    return toy, mxfp4


def start(path: Path, work: Path):
    model, tokenizer, _, _ = load_checkpoint_model(path, work, device="cpu")
    generator = RecordingGenerator(model, tokenizer, path.name, checkpoint_digest(path))
    server = serve(generator)
    host, port = server.server_address[:2]
    return server, generator, f"http://{host}:{port}/v1"


def samples(out: Path, arm: str, run: str) -> list[dict]:
    path = out / "runs" / arm / run / "samples.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def gsm8k_data(tmp_path: Path) -> Path:
    return SHARED_GSM8K if (SHARED_GSM8K / "test.jsonl").exists() else write_gsm8k_dir(tmp_path / "gsm8k")


def test_gsm8k_boxed_and_gpqa_with_thinking_against_the_projects_server(models, tmp_path):
    toy, mxfp4 = models
    servers = [start(path, tmp_path / f"work-{path.name}") for path in (toy, mxfp4)]
    try:
        (_, base_gen, base_url), (_, cand_gen, cand_url) = servers
        # the server's reasoning parser: thinking on, the whole generation is reasoning_content, the answer empty
        body = {"model": toy.name, "max_tokens": 8, "messages": [{"role": "user", "content": "What is 2 + 3?"}]}
        for thinking, reasoning in ((True, True), (False, False)):
            request = urllib.request.Request(
                f"{base_url}/chat/completions", method="POST", headers={"Content-Type": "application/json"},
                data=json.dumps({**body, "chat_template_kwargs": {"enable_thinking": thinking}}).encode())
            with urllib.request.urlopen(request, timeout=120) as r:
                message = json.load(r)["choices"][0]["message"]
            assert base_gen.rendered[-1].endswith("<think>" if thinking else "<think></think>")
            assert bool(message.get("reasoning_content")) is reasoning and bool(message["content"]) is not reasoning
        base_gen.rendered.clear()

        out = tmp_path / "served"
        report = evaluate(EvalRequest(
            candidate=cand_url, baseline=base_url, out=out, tasks="gsm8k_boxed,gpqa_diamond", limit=LIMIT, seeds=1,
            data_dir=gsm8k_data(tmp_path), gpqa_csv=write_gpqa_csv(tmp_path / "gpqa.csv", n=LIMIT), max_gen_toks=16,
            endpoint="chat", thinking="on", concurrency=1), log=lambda m: None).to_json()
    finally:
        for server, _, _ in servers:
            server.shutdown()
            server.server_close()
    assert report["settings"]["thinking"] == "on"
    assert {(r["task"], r["filter"]) for r in report["rows"]} == {
        ("gsm8k_boxed", "math-verify"), ("gpqa_diamond", "flexible-extract"), ("gpqa_diamond", "strict-match")}
    for generator in (base_gen, cand_gen):  # every question asked once per task, each with thinking switched on
        assert len(generator.rendered) == 2 * LIMIT
        assert all(p.endswith("<think>") for p in generator.rendered)
        assert sum("inside \\boxed{}" in p for p in generator.rendered) == LIMIT
    for arm in ("baseline", "candidate"):
        for run in ("gsm8k_boxed", "gpqa_diamond-seed0"):
            rows = samples(out, arm, run)
            # reasoning only: nothing reached the answer, so nothing was extracted or scored
            assert rows and all(r["response"] == "" and r["empty"] and r["score"] == 0.0 for r in rows), run
            assert all(r["extracted"] in ("", "[invalid]") for r in rows)
    row = next(r for r in report["rows"] if r["task"] == "gsm8k_boxed")
    assert row["baseline_generations"]["empty"] == LIMIT and row["candidate_generations"]["empty"] == LIMIT
    assert report["verdict"] == "invalid"  # both arms at the floor: the setup (a toy that never stops thinking)


def test_in_process_thinking_measures_mtp_acceptance_on_the_reasoning(models, tmp_path):
    toy, mxfp4 = models
    out = tmp_path / "in-process"
    report = evaluate(EvalRequest(
        candidate=str(mxfp4), baseline=str(toy), out=out, tasks="gsm8k_boxed", limit=LIMIT,
        data_dir=gsm8k_data(tmp_path), max_gen_toks=16, thinking="on", batch_size=LIMIT), log=lambda m: None).to_json()
    assert report["baseline"]["mtp"]["measured"] and report["candidate"]["mtp"]["measured"]
    for arm in ("baseline", "candidate"):
        rows = samples(out, arm, "gsm8k_boxed")
        assert len(rows) == LIMIT
        for r in rows:
            assert r["prompt"].endswith("<think>") and "inside \\boxed{}" in r["prompt"]
            assert r["response"] and r["extracted"] == "" and r["score"] == 0.0  # all of it reasoning, none scored
            assert r["mtp"]["positions"] > 0  # the draft measured on the generation, reasoning included
    assert next(r for r in report["rows"] if r["primary"])["acceptance"] is not None
