"""The 2026 incidents of issue #31 item 5 as preflight rules (manifests/engines/; each test fails without its rule)."""

from __future__ import annotations

import pytest

from quant.engines import all_profiles
from quant.verify import verify_checkpoint
from synthetic import glm_moe_dsa_config, glm_moe_dsa_layout, quark_layout, write_checkpoint

EVERY = [p.label for p in all_profiles()]  # every profiled release, whatever files manifests/engines/ holds


def _hits(report, rule: str) -> set[tuple[str, str]]:
    return {(f.engine, v) for f in report.errors if rule in f.rule for v in f.versions}


# ---- intel/auto-round#1984: a layer_types list whose length disagrees with num_hidden_layers --------------------

def test_layer_types_of_another_length_than_num_hidden_layers(tmp_path):
    from transformers import AutoConfig

    cfg = glm_moe_dsa_config()  # 3 decoder layers and one MTP layer
    tensors, config = quark_layout(cfg, glm_moe_dsa_layout(cfg))
    right, wrong = ["full_attention"] * 3, ["full_attention"] * 4  # the second lists the MTP layer too
    # The reference: transformers' config class (what every engine reads config.json with) refuses the one only.
    config_class = AutoConfig.for_model("glm_moe_dsa").__class__
    config_class.from_dict(dict(cfg, layer_types=right))
    with pytest.raises(Exception, match=r"must be equal to the number of `layer_types` \(4\)"):
        config_class.from_dict(dict(cfg, layer_types=wrong))

    good = verify_checkpoint(write_checkpoint(tmp_path / "good", dict(config, layer_types=right), tensors), EVERY)
    assert _hits(good, "layer_types") == set()
    bad = verify_checkpoint(write_checkpoint(tmp_path / "bad", dict(config, layer_types=wrong), tensors), EVERY)
    assert _hits(bad, "layer_types") == {tuple(e.split("==")) for e in EVERY}
    finding = next(f for f in bad.errors if "layer_types" in f.rule and f.engine == "vllm")
    assert finding.tensor == "config.json:layer_types"
    assert "layer_types has 4 entries and num_hidden_layers is 3" in finding.message
    assert "must be equal to the number of `layer_types` (4)" in finding.message
    old = next(f for f in bad.errors if "layer_types" in f.rule and "0.5.12" in f.versions)
    assert "number of layer types (4)" in old.message  # transformers 5.6.0's wording (SGLang 0.5.12's pin)

    nested = dict(config, text_config={"num_hidden_layers": 3, "layer_types": wrong})
    report = verify_checkpoint(write_checkpoint(tmp_path / "nested", nested, tensors), ["vllm==0.33"])
    assert [f.tensor for f in report.errors if "layer_types" in f.rule] == ["config.json:text_config.layer_types"]
