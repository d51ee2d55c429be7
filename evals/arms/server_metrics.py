"""Draft acceptance read from a server that runs speculative decoding (MTP/EAGLE), per arm.

vLLM (read in vllm 0.32, v1/spec_decode/metrics.py SpecDecodingProm): Prometheus counters on GET /metrics,
`vllm:spec_decode_num_drafts_total`, `vllm:spec_decode_num_draft_tokens_total`,
`vllm:spec_decode_num_accepted_tokens_total` and `vllm:spec_decode_num_accepted_tokens_per_pos_total{position=i}`,
one series per engine (summed here). They exist only when the server was started with a speculative config. The
arm's figure is the difference of two scrapes, before and after its requests (so nothing else may use the server
meanwhile): mean accepted length = 1 + accepted / drafts (vLLM's own "Mean acceptance length"), acceptance rate =
accepted / draft tokens, depth-1 acceptance = accepted at position 0 / drafts. vLLM returns no per-request figure,
so a vLLM arm has no per-question pairing.

SGLang: the OpenAI endpoints carry no speculative statistics (entrypoints/openai/serving_completions.py builds
choices from text, logprobs and finish_reason only); the native POST /generate always returns `meta_info` with
`completion_tokens` and `spec_verify_ct` (verification rounds), and SGLang's own spec tests compute the accept
length as completion_tokens / spec_verify_ct (python/sglang/test/kits, SpecCorrectnessKit.test_acc_length). So after
the arm's run each greedy generation is replayed through /generate with the same prompt, max_new_tokens and stop
strings (greedy speculative decoding is lossless, so it is the same generation), giving per question `rounds` and
`tokens`: the SGLang arm pairs per question on the mean accepted length. Where meta_info also carries the
accepted draft count (spec_num_correct_drafts, or its older names), tokens = rounds + accepted drafts, i.e. vLLM's
1 + accepted / rounds; completion_tokens / spec_verify_ct, SGLang's own spec_accept_length, also counts the token
the prefill produced (+1/rounds) and is the fallback for releases without the count. GET /get_server_info tells
whether the server speculates (`speculative_algorithm`).
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from dataclasses import dataclass

from evals.arms.backends import api_root

VLLM_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
}
VLLM_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
# SGLang's per-request count of accepted draft tokens, by release: spec_num_correct_drafts (current),
# spec_accepted_drafts (intermediate), spec_accept_token_num (older); tokenizer_manager.py
# _calculate_spec_decoding_metrics.
CORRECT_DRAFT_FIELDS = ("spec_num_correct_drafts", "spec_accepted_drafts", "spec_accept_token_num")
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')
_POSITION = re.compile(r'position="(\d+)"')


def server_root(url: str) -> str:
    """http://h:p/v1/completions -> http://h:p (where /metrics, /generate and /get_server_info live)."""
    root = api_root(url)
    return root[: -len("/v1")] if root.endswith("/v1") else root


def _get(url: str, timeout: float) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError):
        return None


def parse_vllm_counters(text: str) -> dict | None:
    """The speculative-decoding counters of a Prometheus exposition, summed over engines; None when absent."""
    sums = {key: 0.0 for key in VLLM_COUNTERS}
    per_position: dict[int, float] = {}
    seen = False
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        for key, metric in VLLM_COUNTERS.items():
            if name == metric:
                sums[key] += value
                seen = True
        if name == VLLM_PER_POSITION:
            pos = _POSITION.search(labels)
            if pos:
                per_position[int(pos.group(1))] = per_position.get(int(pos.group(1)), 0.0) + value
    if not seen:
        return None
    sums["per_position"] = [per_position[i] for i in sorted(per_position)]
    return sums


def vllm_figures(before: dict, after: dict) -> dict:
    """Per-arm figures from two counter scrapes."""
    d = {k: after[k] - before[k] for k in VLLM_COUNTERS}
    positions = [a - b for a, b in zip(after["per_position"], before["per_position"] + [0.0] * 64)]
    drafts = d["drafts"]
    return {
        "drafts": int(drafts), "draft_tokens": int(d["draft_tokens"]), "accepted": int(d["accepted"]),
        "accepted_per_position": [int(p) for p in positions],
        "mean_accepted_length": 1 + d["accepted"] / drafts if drafts else None,
        "acceptance_rate": d["accepted"] / d["draft_tokens"] if d["draft_tokens"] else None,
        "depth1_rate": positions[0] / drafts if drafts and positions else None,
        "depth": len(positions) or None,
    }


@dataclass
class ServerSpec:
    """How one server arm's acceptance is read: `kind` "vllm" | "sglang" | None (does not speculate, or
    cannot tell), `why` when None."""

    root: str
    kind: str | None
    why: str = ""
    before: dict | None = None
    info: dict | None = None


def probe(url: str, timeout: float = 30.0) -> ServerSpec:
    """Which engine serves `url` and whether it speculates; for vLLM, the counters before the arm runs."""
    root = server_root(url)
    info_text = _get(f"{root}/get_server_info", timeout)
    if info_text is not None:
        try:
            info = json.loads(info_text)
        except ValueError:
            info = None
        if isinstance(info, dict) and "speculative_algorithm" in info:
            if not info.get("speculative_algorithm"):
                return ServerSpec(root, None, "the SGLang server does not speculate (speculative_algorithm is "
                                              "null)")
            return ServerSpec(root, "sglang", info=info)
    metrics = _get(f"{root}/metrics", timeout)
    if metrics is not None and "vllm:" in metrics:
        counters = parse_vllm_counters(metrics)
        if counters is None:
            return ServerSpec(root, None, "the vLLM server does not speculate (no vllm:spec_decode_* counters on "
                                          "/metrics)")
        return ServerSpec(root, "vllm", before=counters)
    return ServerSpec(root, None, "the server exposes neither SGLang's /get_server_info nor vLLM's /metrics "
                                  "speculative counters")


def vllm_arm(spec: ServerSpec, timeout: float = 30.0) -> dict:
    after = parse_vllm_counters(_get(f"{spec.root}/metrics", timeout) or "")
    if after is None:
        return {"measured": False, "why": f"{spec.root}/metrics lost its speculative counters during the run"}
    figures = vllm_figures(spec.before, after)
    if not figures["drafts"]:
        return {"measured": False, "why": "the vLLM server made no drafts during the run (started with "
                                          "--disable-log-stats? its counters then stay at 0)"}
    return {"measured": True, "source": "vLLM /metrics spec_decode counters (difference over the arm's run; "
                                        "no per-question pairing)", **figures}


def sglang_replay(spec: ServerSpec, prompt: str, max_new_tokens: int, stop: list[str], timeout: float) -> dict:
    """One greedy generation through SGLang's /generate: its verification rounds and tokens."""
    body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                                "stop": stop}}
    request = urllib.request.Request(f"{spec.root}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        meta = json.load(response)["meta_info"]
    rounds = int(meta.get("spec_verify_ct") or 0)
    correct = next((meta[k] for k in CORRECT_DRAFT_FIELDS if meta.get(k) is not None), None)
    if correct is not None and rounds:
        # each verification round yields its accepted drafts plus the target's own token; completion_tokens
        # would also count the prefill's token, which no round produced
        return {"rounds": rounds, "tokens": rounds + int(correct)}
    return {"rounds": rounds, "tokens": int(meta["completion_tokens"])}
