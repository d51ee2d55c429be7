"""Teacher-forced log-probabilities of a causal LM: torch only, so the engine probes that run in venvs without
this package (transformers_probe.py in .venv-quark) and the tests share one definition."""

from __future__ import annotations

import torch


def teacher_forced(model, prompts: list[list[int]]) -> list[list[float]]:
    """For each prompt, log p(token i | tokens < i) for i >= 1."""
    rows = []
    with torch.no_grad():
        for ids in prompts:
            logits = model(torch.tensor([ids])).logits[0].float()
            logp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
            rows.append(logp.tolist())
    return rows
