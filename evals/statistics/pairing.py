"""Pair the two arms' answers question by question.

A pair is only valid when both models saw the same prompt: same doc id, same document (doc hash) and same
prompt (prompt hash: identical few-shot examples, identical GPQA answer order). Anything else is an error, not a
silently dropped question. Failed and empty generations stay in (scored wrong) and are counted.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from quant.errors import QuantError


@dataclass(frozen=True)
class PairedScores:
    task: str
    filter: str
    doc_ids: list[int]
    seeds: list[int]
    baseline: np.ndarray       # per question, mean over seeds
    candidate: np.ndarray


@dataclass(frozen=True)
class GenerationCounts:
    """Per arm and task: generations made, failed after retries, and empty (both scored wrong)."""

    generations: int
    failed: int
    empty: int

    def to_json(self) -> dict:
        return {"generations": self.generations, "failed": self.failed, "empty": self.empty}


def _index(records: list[dict], task: str, filter_name: str, arm: str) -> dict[tuple[int, int], dict]:
    index = {}
    for r in records:
        if r["task"] == task and r["filter"] == filter_name:
            key = (r["seed"], r["doc_id"])
            if key in index:
                raise QuantError(f"{arm} {task} {filter_name}: doc_id {key[1]} (seed {key[0]}) recorded twice")
            index[key] = r
    return index


def pair_scores(baseline: list[dict], candidate: list[dict], task: str, filter_name: str) -> PairedScores:
    """Aligned per-question scores of both arms for one task and filter; QuantError on any mismatch."""
    base = _index(baseline, task, filter_name, "baseline")
    cand = _index(candidate, task, filter_name, "candidate")
    if not base and not cand:
        raise QuantError(f"{task} {filter_name}: neither arm has results")
    only_base, only_cand = sorted(base.keys() - cand.keys()), sorted(cand.keys() - base.keys())
    if only_base or only_cand:
        side, keys = ("baseline", only_base) if only_base else ("candidate", only_cand)
        seed, doc = keys[0]
        raise QuantError(f"{task}: {len(keys)} question(s) only the {side} answered (first: doc_id {doc}, seed "
                         f"{seed}); both arms must run the same questions (same --limit and data)")
    for key in sorted(base):
        b, c = base[key], cand[key]
        for field, what in (("doc_hash", "document"), ("prompt_hash", "prompt")):
            if b[field] != c[field]:
                raise QuantError(
                    f"{task} doc_id {key[1]} (seed {key[0]}): the {what} differs between baseline and candidate "
                    f"({field} {b[field][:12]} vs {c[field][:12]}); both must see identical prompts (same data, "
                    f"few-shot examples, answer order and endpoint type)")
    by_doc: dict[int, dict[int, tuple[float, float]]] = defaultdict(dict)
    for (seed, doc), b in base.items():
        by_doc[doc][seed] = (b["score"], cand[(seed, doc)]["score"])
    seeds = sorted({seed for seed, _ in base})
    incomplete = [doc for doc, per_seed in by_doc.items() if len(per_seed) != len(seeds)]
    if incomplete:
        raise QuantError(f"{task}: doc_id {incomplete[0]} lacks some of the seeds {seeds}")
    doc_ids = sorted(by_doc)
    scores = np.array([[np.mean([by_doc[d][s][arm] for s in seeds]) for arm in (0, 1)] for d in doc_ids])
    return PairedScores(task=task, filter=filter_name, doc_ids=doc_ids, seeds=seeds,
                        baseline=scores[:, 0], candidate=scores[:, 1])


def generation_counts(records: list[dict], task: str, filter_name: str) -> GenerationCounts:
    """Counts over one filter's records, so each generation is counted once."""
    rows = [r for r in records if r["task"] == task and r["filter"] == filter_name]
    return GenerationCounts(generations=len(rows), failed=sum(r["failed"] for r in rows),
                            empty=sum(r["empty"] and not r["failed"] for r in rows))


ACCEPTANCE_COUNTS = ("positions", "accepted_depth1", "rounds", "tokens")


def pair_acceptance(baseline: list[dict], candidate: list[dict], task: str, filter_name: str
                    ) -> tuple[list[dict], list[dict]] | None:
    """Aligned per-question MTP acceptance counts of both arms (summed over seeds, so the question stays the
    unit), or None when either arm's records carry none. Call after `pair_scores` has checked the pairing."""
    base = _index(baseline, task, filter_name, "baseline")
    cand = _index(candidate, task, filter_name, "candidate")
    if not base or any(r.get("mtp") is None for r in (*base.values(), *cand.values())):
        return None
    arms = ([], [])
    for doc in sorted({d for _, d in base}):
        for out, index in zip(arms, (base, cand)):
            rows = [r["mtp"] for (s, d), r in index.items() if d == doc]
            out.append({**{k: sum(r[k] for r in rows) for k in ACCEPTANCE_COUNTS}, "depth": rows[0]["depth"]})
    return arms
