"""The server path of MTP acceptance (evals/arms/server_metrics.py) against vLLM's own Prometheus code: vLLM's
SpecDecodingProm and SpecDecodingStats (v1/spec_decode/metrics.py) count drafts exactly as the engine does, the
exposition is prometheus_client's, and the arm figures must be vLLM's own formulas (mean acceptance length
1 + accepted / drafts, acceptance rate accepted / draft tokens, per position accepted_i / drafts). What is stood
in for: the SpeculativeConfig (only num_speculative_tokens is read) and the engine loop that calls observe()."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from evals.arms.server_metrics import parse_vllm_counters, vllm_figures

pytest.importorskip("vllm")


def test_arm_figures_equal_vllms_own_formulas():
    import prometheus_client
    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

    registry_before = prometheus_client.generate_latest().decode()
    prom = SpecDecodingProm(SimpleNamespace(num_speculative_tokens=3), ["model_name", "engine"],
                            {0: ["toy", "0"], 1: ["toy", "1"]})
    before = parse_vllm_counters(prometheus_client.generate_latest().decode())
    assert parse_vllm_counters(registry_before) is None  # no speculative config, no counters
    drafts = [(3, 2), (3, 3), (3, 0), (3, 1), (3, 3)]
    for engine in (0, 1):
        stats = SpecDecodingStats.new(3)
        for draft_tokens, accepted in drafts:
            stats.observe_draft(num_draft_tokens=draft_tokens, num_accepted_tokens=accepted)
        prom.observe(stats, engine_idx=engine)
    after = parse_vllm_counters(prometheus_client.generate_latest().decode())
    figures = vllm_figures(before, after)
    n, accepted = 2 * len(drafts), 2 * sum(a for _, a in drafts)
    assert figures["drafts"] == n and figures["accepted"] == accepted and figures["depth"] == 3
    assert figures["mean_accepted_length"] == pytest.approx(1 + accepted / n)
    assert figures["acceptance_rate"] == pytest.approx(accepted / (3 * n))
    assert figures["accepted_per_position"] == [2 * sum(a > i for _, a in drafts) for i in range(3)]
    assert figures["depth1_rate"] == pytest.approx(2 * sum(a > 0 for _, a in drafts) / n)
