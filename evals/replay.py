"""An arm's MTP draft acceptance, attached to its records: in process, the arm's own draft verified greedily over
its generations (evals/arms/mtp_measure.py); from a server, vLLM's counters over the run, or a greedy replay of
every greedy generation through SGLang's /generate, each replay kept in the answer store as it arrives (a resumed
run replays only what is missing)."""

from __future__ import annotations

import json

from evals.arms import server_metrics
from evals.arms import server_metrics as server_spec
from evals.arms.answers import request_key
from evals.arms.backends import Backend, BackendOptions
from evals.arms.lm_eval_run import RunSettings
from evals.arms.mtp_measure import measure_records


def server_mtp(spec, records: list[dict], specs, settings: RunSettings, options: BackendOptions, log,
               store=None) -> dict:
    """A server arm's acceptance (evals/arms/server_metrics.py): vLLM's counters over the run, or SGLang's per-request
    meta_info from a greedy /generate replay of every greedy generation (attached to its records; each replay kept
    in `store` as it arrives, like the answers, so a resumed run replays only what is missing)."""

    if spec.kind is None:
        return {"measured": False, "why": spec.why}
    if spec.kind == "vllm":
        return server_spec.vllm_arm(spec)
    greedy = {s.name: s for s in specs if not s.sampled}
    replayed: dict[tuple, dict] = {}
    for r in records:
        key = (r["task"], r["seed"], r["doc_id"])
        if r["task"] not in greedy or key in replayed or r.get("prompt") is None:
            continue
        max_new = settings.gen_kwargs(greedy[r["task"]])["max_gen_toks"]
        counts = _kept_replay(store, spec, r["prompt"], max_new, r.get("until") or [], options.timeout)
        replayed[key] = {"positions": 0, "accepted_depth1": 0, **counts, "depth": None}
    for r in records:
        r["mtp"] = replayed.get((r["task"], r["seed"], r["doc_id"]))
    if not replayed:
        return {"measured": False, "why": "no greedy task with a completion prompt to replay through SGLang's "
                                          "/generate (chat prompts are not replayed)"}
    rounds = sum(q["rounds"] for q in replayed.values())
    tokens = sum(q["tokens"] for q in replayed.values())
    log(f"  SGLang accepted length {tokens / max(rounds, 1):.2f} over {len(replayed)} replayed generations")
    return {"measured": True, "source": "SGLang /generate meta_info (completion_tokens / spec_verify_ct), greedy "
                                        "replay of each generation", "generations": len(replayed),
            "mean_accepted_length": tokens / rounds if rounds else None,
            "speculative_algorithm": (spec.info or {}).get("speculative_algorithm"),
            "depth": (spec.info or {}).get("speculative_num_steps")}


def _kept_replay(store, spec, prompt: str, max_new: int, until: list[str], timeout: float) -> dict:
    key = request_key(store.digest, "sglang_generate", (prompt, max_new, until), 0) if store else None
    kept = store.get(key) if store else None
    if kept is not None:
        return json.loads(kept)
    counts = server_metrics.sglang_replay(spec, prompt, max_new, until, timeout)
    if store:
        store.put(key, json.dumps(counts))
        store.commit()
    return counts


def measure_mtp(backend: Backend, records: list[dict], depth: int, log) -> dict:
    """Attach each generation's MTP acceptance to its records (every filter of it); what was measured, or why
    nothing was."""
    if backend.draft is None:
        return {"measured": False, "why": backend.draft_note or "no MTP draft"}

    log(f"  {backend.label}: MTP draft acceptance (depth {depth}, {len(backend.draft.layers)} MTP layer(s))")
    measured = measure_records(backend.lm, backend.draft, records, depth, log=log)
    for r in records:
        q = measured.get((r["task"], r["seed"], r["doc_id"]))
        r["mtp"] = q.to_json() if q else None
    return {"measured": True, "source": "in-process draft (evals/arms/mtp_draft.py), greedy verification",
            "depth": depth, "layers": len(backend.draft.layers)}
