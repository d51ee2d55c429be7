"""A small OpenAI-compatible server over transformers `generate`, for evaluating a checkpoint through the same
server backend as SGLang/vLLM (and for testing that backend): `python -m evals.arms.model_server CKPT --port 8000`.

Endpoints: GET /v1/models, POST /v1/completions (prompt: string or list of strings), POST /v1/chat/completions
(`chat_template_kwargs` such as `enable_thinking` reach the tokenizer's chat template; with a template that thinks,
the reasoning comes back as `message.reasoning_content` and only the answer as `content`, as SGLang's and vLLM's
reasoning parsers return it).
Requests are served one generation at a time (a lock around the model). Quantized checkpoints are dequantized
into BF16 first, their activations emulated or not as in the in-process backend (--activations). With --idle-timeout
the server stops itself after that many seconds without a request.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from evals.arms.answers import checkpoint_digest
from evals.arms.backends import load_checkpoint_model
from evals.arms.tasks import THINK_CLOSE, THINK_OPEN, split_reasoning
from quant.errors import QuantError

MAX_BODY_BYTES = 64 * 1024 * 1024


class Generator:
    """The model behind the endpoints; one generation at a time."""

    def __init__(self, model, tokenizer, name: str, digest: str | None = None):
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.digest = digest  # the checkpoint's (evals.arms.answers.checkpoint_digest), listed at /v1/models
        self.lock = threading.Lock()

    def render_chat(self, messages: list[dict], template_kwargs: dict | None = None) -> str:
        """The tokenizer's chat template (given `template_kwargs`), or, for a tokenizer without one (base models,
        the toy), the plain few-shot layout lm-eval's completion prompts use: user turns as written, each assistant
        turn after a space and followed by a blank line."""
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      **(template_kwargs or {}))
        parts = []
        for m in messages:
            content = m.get("content") or ""
            if m.get("role") == "assistant":
                parts.append((content if content[:1].isspace() else " " + content) + "\n\n")
            elif m.get("role") == "system":
                parts.append(content + "\n")
            else:
                parts.append(content)
        return "".join(parts)

    def complete(self, prompt: str, *, max_tokens: int, temperature: float, top_p: float, stop: list[str],
                 seed: int | None) -> tuple[str, str, int, int]:
        """(text, finish_reason, prompt tokens, completion tokens)."""
        import torch

        enc = self.tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
        ids = enc["input_ids"].to(self.model.device)
        sample = temperature > 0
        kwargs = {"max_new_tokens": max(1, int(max_tokens)), "do_sample": sample,
                  "pad_token_id": self.tokenizer.pad_token_id or self.tokenizer.eos_token_id}
        if sample:
            kwargs.update(temperature=float(temperature), top_p=float(top_p))
        if stop:
            kwargs.update(stop_strings=list(stop), tokenizer=self.tokenizer)
        with self.lock, torch.no_grad():
            if seed is not None:
                torch.manual_seed(int(seed))
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
        new = out[0, ids.shape[1]:].tolist()
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in stop or []) if i >= 0), default=-1)
        finished = cut >= 0 or (new and new[-1] == self.tokenizer.eos_token_id) or len(new) < kwargs["max_new_tokens"]
        if cut >= 0:
            text = text[:cut]
        return text, "stop" if finished else "length", ids.shape[1], len(new)


def chat_message(generator, messages: list[dict], template_kwargs: dict,
                 sampling: dict) -> tuple[dict, str, int, int]:
    """(assistant message, finish_reason, prompt tokens, completion tokens) from `generator`'s render_chat and
    complete. With a template that thinks (its generation prompt opens <think>, or the generation does) the
    reasoning is split off into `reasoning_content`, as SGLang's and vLLM's reasoning parsers return it."""
    prompt = generator.render_chat(messages, template_kwargs)
    text, reason, n_in, n_out = generator.complete(prompt, **sampling)
    message = {"role": "assistant", "content": text}
    opened = prompt.rstrip().endswith(THINK_OPEN)
    if opened or THINK_OPEN in text or THINK_CLOSE in text:
        message["reasoning_content"], message["content"] = split_reasoning(text, opened=opened)
    return message, reason, n_in, n_out


def _sampling(body: dict) -> dict:
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    return {"max_tokens": body.get("max_tokens") or 256, "temperature": float(body.get("temperature") or 0.0),
            "top_p": float(body.get("top_p") or 1.0), "stop": stop, "seed": body.get("seed")}


def make_handler(generator: Generator, touch):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # quiet: one line per request is noise for eval runs
            pass

        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            touch()
            if self.path.rstrip("/") in ("/v1/models", "/models"):
                entry = {"id": generator.name, "object": "model", "owned_by": "evals.arms.model_server"}
                if generator.digest:
                    entry["checkpoint_digest"] = generator.digest
                self._send(200, {"object": "list", "data": [entry]})
            elif self.path.rstrip("/") in ("/health", "/v1/health"):
                self._send(200, {"status": "ok"})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            touch()
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                self._send(413, {"error": {"message": "request too large"}})
                return
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
                route = self.path.rstrip("/")
                if route in ("/v1/completions", "/completions"):
                    self._send(200, self._completions(body))
                elif route in ("/v1/chat/completions", "/chat/completions"):
                    self._send(200, self._chat(body))
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}"}})
            except (ValueError, KeyError, TypeError) as e:
                self._send(400, {"error": {"message": f"bad request: {e}"}})
            finally:
                touch()

        def _completions(self, body: dict) -> dict:
            prompts = body["prompt"]
            if isinstance(prompts, str):
                prompts = [prompts]
            if not all(isinstance(p, str) for p in prompts):
                raise ValueError("prompt must be a string or a list of strings")
            choices, usage = [], [0, 0]
            for i, prompt in enumerate(prompts):
                text, reason, n_in, n_out = generator.complete(prompt, **_sampling(body))
                choices.append({"index": i, "text": text, "finish_reason": reason, "logprobs": None})
                usage[0] += n_in
                usage[1] += n_out
            return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                    "model": generator.name, "choices": choices,
                    "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1],
                              "total_tokens": sum(usage)}}

        def _chat(self, body: dict) -> dict:
            messages = body["messages"]
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise ValueError("messages must be a list of objects")
            kwargs = body.get("chat_template_kwargs") or {}
            if not isinstance(kwargs, dict):
                raise ValueError("chat_template_kwargs must be an object")
            message, reason, n_in, n_out = chat_message(generator, messages, kwargs, _sampling(body))
            return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                    "model": generator.name,
                    "choices": [{"index": 0, "message": message, "finish_reason": reason}],
                    "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}}

    return Handler


def serve(generator: Generator, host: str = "127.0.0.1", port: int = 0,
          idle_timeout: float | None = None) -> ThreadingHTTPServer:
    """Start serving in a background thread; returns the server (`server.server_address`, `server.shutdown()`,
    `server.stopped`: an Event set when it has stopped).

    With `idle_timeout`, a watchdog shuts the server down after that many seconds without a request."""
    last = [time.monotonic()]

    def touch():
        last[0] = time.monotonic()

    server = ThreadingHTTPServer((host, port), make_handler(generator, touch))
    server.daemon_threads = True
    server.stopped = threading.Event()  # set once serve_forever has returned

    def run():
        try:
            server.serve_forever()
        finally:
            server.stopped.set()

    threading.Thread(target=run, name="evals-server", daemon=True).start()
    if idle_timeout:
        def watchdog():
            while time.monotonic() - last[0] < idle_timeout:
                time.sleep(min(1.0, idle_timeout / 4))
            server.shutdown()

        threading.Thread(target=watchdog, name="evals-server-idle", daemon=True).start()
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.arms.model_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="checkpoint directory (BF16, or quantized: dequantized first)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed on start)")
    parser.add_argument("--model-name", default=None, help="id served at /v1/models (default: directory name)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    parser.add_argument("--activations", default=None, choices=("emulate", "bf16"),
                        help="quantized checkpoints: emulate activation quantization (default where the scheme "
                             "quantizes them) or keep BF16")
    parser.add_argument("--idle-timeout", type=float, default=None, help="stop after this many idle seconds")
    args = parser.parse_args(argv)


    try:
        with tempfile.TemporaryDirectory(prefix="evals-server-") as work:
            model, tokenizer, description, _ = load_checkpoint_model(args.checkpoint, Path(work), dtype=args.dtype,
                                                                     device=args.device,
                                                                     activations=args.activations)
    except QuantError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.model_name or args.checkpoint.resolve().name
    generator = Generator(model, tokenizer, name, checkpoint_digest(args.checkpoint))
    server = serve(generator, args.host, args.port, args.idle_timeout)
    host, port = server.server_address[:2]
    print(f"serving {name} ({description}) on http://{host}:{port}/v1", flush=True)
    try:
        server.stopped.wait()
    except KeyboardInterrupt:
        server.shutdown()
    server.server_close()
    print("server stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
