"""The model card every export carries, `quant eval --card`, and `--devices auto`."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from evals.statistics import accuracy
from evals.report.card import CARD_IMAGE, add_accuracy
from quant.pipeline import auto_devices, quantize_checkpoint
from quant.pipeline.model_card import ACCURACY_END, ACCURACY_START
from quant.toy import build_toy

SNAPSHOT = Path(__file__).parent / "data" / "model_card_glm5.md"


def export(tmp_path: Path) -> Path:
    src = build_toy("glm5", tmp_path / "glm5")
    quantize_checkpoint(src, tmp_path / "glm5-mxfp4", log=lambda m: None)
    return tmp_path / "glm5-mxfp4"


def test_card_matches_the_snapshot(tmp_path):
    """On an intended change, copy the card the failure prints over tests/data/model_card_glm5.md."""
    card = (export(tmp_path) / "README.md").read_text()
    assert card == SNAPSHOT.read_text(), card
    assert str(tmp_path) not in card  # no machine paths leak into a published card


def test_eval_card_replaces_the_accuracy_section(tmp_path):
    out = export(tmp_path)
    base = np.array([1] * 180 + [0] * 20, dtype=float)
    cand = base.copy()
    cand[:4] = 0
    comparison = accuracy.compare(base, cand, margin=0.02).to_json()
    report = {"verdict": comparison["verdict"], "margin_points": 2.0, "baseline": {"name": "glm5-fp8"},
              "rows": [{"label": "GSM8K 5-shot", "primary": True, "comparison": comparison},
                       {"label": "GSM8K 5-shot", "primary": False, "comparison": comparison}]}
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "report.png").write_bytes(b"\x89PNG fake")
    for _ in range(2):  # idempotent: the second run replaces, not appends
        add_accuracy(out, report, tmp_path / "report")
    card = (out / "README.md").read_text()
    assert card.count(ACCURACY_START) == card.count(ACCURACY_END) == 1
    assert "| GSM8K 5-shot (200 questions) | 90.0% | 88.0% | -2.0 |" in card, card
    assert f"![paired comparison]({CARD_IMAGE})" in card and (out / CARD_IMAGE).exists()
    assert "Not evaluated yet" not in card and card.index("## Accuracy") < card.index("## Reproduce")


def test_auto_devices_prefers_every_visible_gpu():
    assert auto_devices(workers=1, accelerators=0) == ["cpu"]
    assert auto_devices(workers=2, accelerators=0) == ["cpu", "cpu"]
    assert auto_devices(workers=1, accelerators=2) == ["cuda:0", "cuda:1"]


def test_the_manifest_records_the_devices_that_ran(tmp_path):
    import json

    out = export(tmp_path)
    assert json.loads((out / "quant_manifest.json").read_text())["run"]["devices"] == ["cpu"]


def test_the_accuracy_section_says_how_each_arm_computed_its_activations():
    """A W4A4 candidate measured with BF16 activations reads better than it serves: the card says which mode ran."""
    from quant.pipeline.model_card import accuracy_section

    comparison = accuracy.compare(np.ones(50), np.ones(50), margin=0.02).to_json()
    report = {"verdict": comparison["verdict"], "margin_points": 2.0,
              "rows": [{"label": "GSM8K 5-shot", "primary": True, "comparison": comparison}],
              "candidate": {"name": "cand", "activations": "emulate"},
              "baseline": {"name": "glm5-fp8", "activations": "server"}}
    section = accuracy_section(report, None)
    assert ("Activations: candidate quantized in process as the export's scheme says (--activations emulate); "
            "baseline as its serving engine computed them.") in section, section
    report["candidate"]["activations"] = "bf16"
    assert "candidate in BF16 in process" in accuracy_section(report, None)
    del report["candidate"]["activations"], report["baseline"]["activations"]
    assert "Activations" not in accuracy_section(report, None)  # a report from before the modes: nothing claimed


def test_a_block_fp8_card_describes_the_config_beside_it(tmp_path):
    """Issue #50 item 3: the card of an fp8-block export said `quant_method: quark` and 'exclude lists 0 entries'
    beside a config of quant_method fp8 with its modules_to_not_convert."""
    import json

    out = tmp_path / "fp8"
    quantize_checkpoint(build_toy("glm5", tmp_path / "glm5"), out, scheme="fp8-block", recipe="all-linear",
                        check_engines=[], log=lambda m: None)
    card = (out / "README.md").read_text()
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "fp8" and "quark" not in card.lower()
    assert "`quant_method: fp8`, `weight_block_size: [128, 128]`" in card
    assert f"`quantization_config.modules_to_not_convert` lists {len(q['modules_to_not_convert'])} entries" in card


def test_the_serve_commands_use_the_checkpoints_tensor_parallel_degree():
    """Issue #50 item 7: `--tp 8` on a 2 MB toy. The degree is the fewest GPUs holding the weights, a divisor of the
    heads."""
    from quant.pipeline.model_card import tensor_parallel

    config = {"num_attention_heads": 64}
    assert tensor_parallel({"summary": {"output_bytes": 2_000_000}}, config) == 1
    assert tensor_parallel({"summary": {"output_bytes": 400e9}}, config) == 8   # a GLM-5-sized MXFP4 export
    assert tensor_parallel({"summary": {"output_bytes": 100e9}}, config) == 2
    assert tensor_parallel({"summary": {"output_bytes": 100e9}}, {"num_attention_heads": 6}) == 2
    assert tensor_parallel({"summary": {"output_bytes": 200e9}}, {"num_attention_heads": 6}) == 2  # 6 heads: no 4
    assert tensor_parallel({"summary": {"output_bytes": 1e12}},
                           {"text_config": {"num_attention_heads": 32}}) == 16
