"""quant.sources.registry: a source format is a row of quant/manifests/source_formats.yaml plus the module its class
lives in. A format this test defines (per-row int8 codes with an F32 scale per row, in a module written to a
temporary directory, its row in a temporary copy of the data file) is recognised, planned, decoded and requantized
through the registry the quantizer reads, and the data file is read strictly like every other one."""

from __future__ import annotations

import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from quant.families.schema import BadData
from quant.sources import native, registry
from quant.sources.source_format import Encoding

FAKE_MODULE = '''
from quant.sources.source_format import SourceFormat


class Int8Rows(SourceFormat):
    """int8 codes, one F32 scale per row: value = code * scale."""

    def decode(self, encoding, weight, scale, what="", global_scale=None):
        return weight.float() * scale.float().reshape(-1, 1)

    def encode(self, x, block=128):
        import torch

        scale = (x.float().abs().amax(-1) / 127.0).clamp(min=1e-12)
        codes = torch.round(x.float() / scale.reshape(-1, 1)).clamp(-127, 127).to(torch.int8)
        return {self.weight: codes, self.scale: scale}
'''
FAKE_ROW = {"class": "fake_int8_rows.Int8Rows", "release": "a test's int8 rows", "weight": ".weight",
            "scale": ".weight_row_scale", "code_dtypes": ["I8"], "scale_dtypes": ["F32"], "blocks": [[1, 0]]}
FAKE_RELEASE = {"release": "a test's int8 rows", "encode": "int8-rows", "roles": ["routed_experts"],
                "ignore_key": "ignore", "quantization_config": {"quant_method": "int8-rows"}}


SHIPPED = registry.SOURCE_FORMATS


def _data_copy(tmp_path: Path, edit) -> Path:
    """An edited copy of the shipped data file, in a directory of its own (the registry is cached per file)."""
    data = yaml.safe_load(SHIPPED.read_text())
    edit(data)
    directory = Path(tempfile.mkdtemp(dir=tmp_path))
    path = directory / "source_formats.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def fake_format(tmp_path, monkeypatch) -> Path:
    """The registry every reader uses, pointed at a data file with one more format (and a release storage written
    in it), whose module sits in a temporary directory."""
    (tmp_path / "fake_int8_rows.py").write_text(textwrap.dedent(FAKE_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))

    def add(data):
        data["encodings"]["int8-rows"] = FAKE_ROW
        data["formats"]["int8-rows"] = FAKE_RELEASE

    monkeypatch.setattr(registry, "SOURCE_FORMATS", _data_copy(tmp_path, add))
    return tmp_path


def test_a_new_format_is_recognised_planned_and_decoded_through_the_registry(fake_format):
    from quant.checkpoint import SourceReader, open_checkpoint
    from quant.families import family_for_config
    from quant.planning.plan import make_plan
    from quant.planning.recipes import load_recipe
    from quant.planning.schemes import SCHEMES
    from quant.toy import build_toy

    src = build_toy("qwen3-moe", fake_format / "toy", source_format="int8-rows")
    ckpt = open_checkpoint(src)
    weights = sorted(n for n in ckpt.tensors if n.endswith(".weight") and ckpt.tensors[n].dtype == "I8")
    assert weights and all(n[: -len(".weight")] + ".weight_row_scale" in ckpt.tensors for n in weights)
    encoding = registry.recognise(ckpt.tensors, weights[0])
    assert encoding == Encoding("int8-rows", weights[0][: -len("weight")] + "weight_row_scale", (1, 0),
                                tuple(ckpt.tensors[weights[0]].shape), weights[0][: -len(".weight")])
    assert native.is_microscaled(ckpt)

    family = family_for_config(ckpt.config)
    plan = make_plan(ckpt, family, load_recipe("experts-only", family), SCHEMES["w_mxfp4_a_mxfp4"], "even")
    jobs = {j.source.name: j for s in plan.shards for j in s.jobs}
    assert plan.source_format == "microscaled"
    assert {jobs[n].source.encoding for n in weights} == {"int8-rows"}
    assert {jobs[n].action for n in weights} == {"quantize"}  # the format passes into no target
    assert not any(n.endswith(".weight_row_scale") for n in jobs)  # consumed with its weight

    reader = SourceReader(ckpt, "cpu")
    source = jobs[weights[0]].source
    codes, scale = reader.raw(source.file, source.name), reader.raw(source.scale_file, source.scale)
    assert torch.equal(native.read_values(reader, source), codes.float() * scale.reshape(-1, 1))


def test_a_new_format_is_requantized_by_the_quantizer(fake_format):
    from safetensors.torch import load_file

    from quant.pipeline import quantize_checkpoint
    from quant.toy import build_toy

    src = build_toy("qwen3-moe", fake_format / "toy", source_format="int8-rows")
    manifest = quantize_checkpoint(src, fake_format / "out", check_engines="", log=lambda m: None)
    records = [r for r in manifest["tensors"].values() if r.get("source_encoding") == "int8-rows"]
    assert records and all(r["action"] == "quantize" for r in records)
    out = {}
    for f in sorted((fake_format / "out").glob("*.safetensors")):
        out.update(load_file(f))
    assert not any(n.endswith(".weight_row_scale") for n in out)


def _refusal(tmp_path, monkeypatch, edit) -> str:
    monkeypatch.setattr(registry, "SOURCE_FORMATS", _data_copy(tmp_path, edit))
    with pytest.raises(BadData) as e:
        registry.current()
    return str(e.value)


def test_an_unknown_key_is_refused_naming_the_file_and_the_key(tmp_path, monkeypatch):
    message = _refusal(tmp_path, monkeypatch, lambda d: d["encodings"]["mxfp4"].update(scales=".scale"))
    assert "source_formats.yaml" in message and "'scales'" in message and "'scale'" in message
    assert "\n" not in message
    message = _refusal(tmp_path, monkeypatch, lambda d: d["formats"]["mxfp8"].update(role=["attention"]))
    assert "source_formats.yaml" in message and "'role'" in message
    message = _refusal(tmp_path, monkeypatch, lambda d: d.update(encoding={}))
    assert "source_formats.yaml" in message and "'encoding'" in message


def test_a_release_storage_must_encode_in_a_known_format(tmp_path, monkeypatch):
    message = _refusal(tmp_path, monkeypatch, lambda d: d["formats"]["mxfp8"].update(encode="mxfp9"))
    assert "mxfp9" in message and "source_formats.yaml" in message


def test_every_shipped_format_is_a_module_of_its_own():
    formats = registry.current().formats
    modules = [type(f).__module__ for f in formats]
    assert len(set(modules)) == len(modules) and all(m.startswith("quant.sources.") for m in modules)
    assert "fp8-block" in [f.name for f in formats]
