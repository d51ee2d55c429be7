"""Sidecars (issue #43 items 2 and 4, DeepSeek-V4.1): the Engram tables its config declares (engram_layer_ids) are
carried over as stored, listed in quant_manifest.json with the sha256 of their bytes, and the preflight fails an
export that lacks one or stores one in another shape than vLLM allocates (exit 1, README's exit-code table)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quant.families.schema import BadData
from quant.families.sidecars import parse_sidecars
from quant.safetensors_header import read_header

TABLE = "layers.1.engram.embed.weight"


def _toy_and_export(tmp_path_factory, toy: str) -> tuple[Path, Path]:
    from quant.pipeline.run import quantize_checkpoint
    from quant.toy import build_toy

    root = tmp_path_factory.mktemp(toy)
    src = build_toy(toy, root / "t")
    quantize_checkpoint(src, root / "t-mx")
    return src, root / "t-mx"


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return _toy_and_export(tmp_path_factory, "deepseek-v4.1")


def _bytes_sha256(shard: Path, name: str) -> str:
    _, start, offsets = read_header(shard)
    begin, end = offsets[name]
    with open(shard, "rb") as f:
        f.seek(start + begin)
        return hashlib.sha256(f.read(end - begin)).hexdigest()


def _verify(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quant", "verify-manifest", str(path), "--json"],
                          capture_output=True, text=True)


def _errors(run: subprocess.CompletedProcess) -> list[dict]:
    return [f for f in json.loads(run.stdout)["findings"] if f["severity"] == "error"]


def _rewrite(export: Path, out: Path, change) -> Path:
    """A copy of the export whose shard is rewritten by `change(tensors)` (the index follows it)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(export, out)
    shard = out / "model.safetensors"
    tensors = load_file(shard)
    change(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in tensors}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def test_declared_tables_are_carried_as_stored_and_listed(export):
    src, out = export
    manifest = json.loads((out / "quant_manifest.json").read_text())
    [engram] = manifest["sidecars"]
    assert (engram["name"], engram["kind"], engram["declared_by"]) == ("engram", "table", "engram_layer_ids")
    assert sorted(engram["tensors"]) == [f"layers.{i}.engram.embed.{p}" for i in (0, 1) for p in ("scale", "weight")]
    for name, rec in engram["tensors"].items():
        assert rec["sha256"] == _bytes_sha256(src / "model.safetensors", name)
        assert rec["sha256"] == _bytes_sha256(out / rec["file"], name)
        assert manifest["tensors"][name]["action"] == "copy" and manifest["tensors"][name]["role"] == "sidecar"
    assert engram["tensors"][TABLE] | {"sha256": None} == {"file": "model.safetensors", "dtype": "F8_E4M3",
                                                           "shape": [384, 64], "sha256": None}
    assert engram["tensors"]["layers.1.engram.embed.scale"]["dtype"] == "F8_E8M0"
    assert "## Sidecars" in (out / "README.md").read_text()
    # The routed experts (stored MXFP4) pass through bit for bit, the DSpark stage's included.
    assert manifest["tensors"]["mtp.0.ffn.experts.0.w1"]["action"] == "passthrough"
    assert _verify(out).returncode == 0


def test_an_export_without_its_engram_table_is_a_named_failure(export, tmp_path):
    _, out = export
    broken = _rewrite(out, tmp_path / "no-engram", lambda t: [t.pop(n) for n in list(t) if ".engram.embed." in n])
    run = _verify(broken)
    assert run.returncode == 1, run.stdout + run.stderr
    named = {f["tensor"] for f in _errors(run) if "engram sidecar (engram_layer_ids)" in f["message"]}
    assert named == {f"layers.{i}.engram.embed.{p}" for i in (0, 1) for p in ("scale", "weight")}


def test_a_table_of_another_shape_is_a_named_failure(export, tmp_path):
    _, out = export
    broken = _rewrite(out, tmp_path / "short", lambda t: t.update({TABLE: t[TABLE][:-1].clone()}))
    run = _verify(broken)
    assert run.returncode == 1, run.stdout + run.stderr
    [error] = _errors(run)
    assert error["tensor"] == TABLE and "engram sidecar (engram_layer_ids)" in error["message"]
    assert "[383, 64] but the engine allocates F8_E4M3 [384, 64]" in error["message"]


def test_a_misspelled_sidecar_key_is_refused():
    with pytest.raises(BadData, match="declard_by"):
        parse_sidecars({"t": {"kind": "table", "declard_by": "x", "tensors": {}}}, "f.yaml")
    with pytest.raises(BadData, match="tensors or a file"):
        parse_sidecars({"t": {"kind": "draft", "declared_by": "x"}}, "f.yaml")


# MiniMax-M3.1-Flash's DSpark draft: a file of its own beside the shards (the minimax_m3_vl family's `dspark`
# sidecar), declared by the top-level dspark_block_size SGLang 0.5.23 reads (dspark_config.py:162-174).
DRAFT = "dspark.safetensors"


@pytest.fixture(scope="module")
def draft_export(tmp_path_factory):
    return _toy_and_export(tmp_path_factory, "minimax-m3.1-flash")


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_draft_file_is_carried_byte_for_byte_listed_and_never_planned(draft_export):
    src, out = draft_export
    manifest = json.loads((out / "quant_manifest.json").read_text())
    assert manifest["sidecars"] == [{"name": "dspark", "kind": "draft", "declared_by": "dspark_block_size",
                                     "file": {"name": DRAFT, "sha256": _file_sha256(src / DRAFT)}}]
    assert (out / DRAFT).read_bytes() == (src / DRAFT).read_bytes()
    assert DRAFT in manifest["output"]["copied_files"] and DRAFT not in manifest["output"]["shards"]
    # No draft tensor is planned (quantized or rewritten into a shard), yet the index lists them all: SGLang reads
    # only the index's files (weight_utils.py:807) and loads the bundled draft from this directory.
    draft_tensors = set(read_header(src / DRAFT)[0])
    assert draft_tensors and not draft_tensors & set(manifest["tensors"])
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert {n for n, f in weight_map.items() if f == DRAFT} == draft_tensors
    # The draft's linears are named in the exclude: SGLang builds the draft with the target's quantization_config.
    assert "language_model.model.dspark.layers.0.decoder_layer.self_attn.q_proj" in manifest["exclude"]
    assert f"`{DRAFT}`" in (out / "README.md").read_text()
    assert _verify(out).returncode == 0


def test_an_export_without_its_draft_file_is_a_named_failure(draft_export, tmp_path):
    _, out = draft_export
    broken = tmp_path / "no-draft"
    shutil.copytree(out, broken)
    (broken / DRAFT).unlink()
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != DRAFT}
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    run = _verify(broken)
    assert run.returncode == 1, run.stdout + run.stderr
    [error] = _errors(run)
    assert error["tensor"] == DRAFT
    assert "declares the dspark sidecar (dspark_block_size) but the export has no file dspark.safetensors" \
        in error["message"]


def test_a_hub_export_with_a_draft_file_is_preflighted_as_its_local_copy(draft_export, tmp_path):
    """Issue #49: `verify-manifest ORG/NAME` on a MiniMax-M3.1-Flash export served by the test hub exited 70
    (`'PurePosixPath' object has no attribute 'is_file'`): the draft file's presence is read from the repository's
    file list (Checkpoint.has_file). With the draft and without it, the same exit code and findings as the local copy."""
    import os

    from hub_server import HubServer

    _, out = draft_export
    broken = tmp_path / "no-draft"
    shutil.copytree(out, broken, ignore=shutil.ignore_patterns(".quant-*"))
    (broken / DRAFT).unlink()
    server = HubServer().start()
    try:
        server.add_repo("org/flash", out)
        server.add_repo("org/flash-no-draft", broken)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
        env.update(HF_ENDPOINT=server.url, HF_HUB_OFFLINE="0", HF_HOME=str(tmp_path / "hf_home"))
        for repo, local in (("org/flash", out), ("org/flash-no-draft", broken)):
            remote = subprocess.run([sys.executable, "-m", "quant", "verify-manifest", repo, "--json"], env=env,
                                    capture_output=True, text=True, timeout=120)
            here = _verify(local)
            assert (remote.returncode, remote.stderr) == (here.returncode, here.stderr), remote.stderr
            assert _errors(remote) == json.loads(json.dumps(_errors(here)).replace(str(local), repo))
    finally:
        server.stop()


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "no-stream"])
def test_a_hub_source_with_a_draft_file_quantizes_to_the_local_bytes(draft_export, tmp_path, streamed):
    """Issue #49: `quant quantize ORG/NAME OUT --max-disk 20MB` of MiniMax-M3.1-Flash never fetched its draft
    (a .safetensors file no shard job reads) and failed its own self-check after all the work. The streamed and the
    download-first runs now give the local export's shards, index and draft."""
    import os

    from hub_server import HubServer

    src, local = draft_export
    server = HubServer().start()
    try:
        server.add_repo("org/flash", src, content_sha=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
        env.update(HF_ENDPOINT=server.url, HF_HUB_OFFLINE="0", HF_HOME=str(tmp_path / "hf_home"))
        out = tmp_path / "out"
        mode = ["--max-disk", "20MB"] if streamed else ["--no-stream"]
        run = subprocess.run([sys.executable, "-m", "quant", "quantize", "org/flash", str(out), "--no-progress",
                              *mode], env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
    finally:
        server.stop()
    for name in sorted(p.name for p in local.glob("*.safetensors")) + ["model.safetensors.index.json"]:
        assert (out / name).read_bytes() == (local / name).read_bytes(), name
    assert _verify(out).returncode == 0


def test_a_nan_byte_in_an_engram_tables_scale_is_found_by_scales(export, tmp_path):
    """Issue #49: a 0xFF (E8M0 NaN) byte in an Engram table's `.scale` passed `verify-manifest --scales`, which read
    only tensors named like weight scales. Every F8_E8M0 tensor is a scale."""
    import torch

    _, out = export
    scale = "layers.1.engram.embed.scale"

    def nan_byte(tensors):
        raw = tensors[scale].view(torch.uint8).clone()
        raw.view(-1)[0] = 0xFF
        tensors[scale] = raw.view(torch.float8_e8m0fnu)

    broken = _rewrite(out, tmp_path / "nan-scale", nan_byte)
    assert _verify(broken).returncode == 0  # the headers are fine: only the scale scan can see it
    run = subprocess.run([sys.executable, "-m", "quant", "verify-manifest", str(broken), "--scales", "--json"],
                         capture_output=True, text=True)
    assert run.returncode == 1, run.stdout + run.stderr
    assert any("0xFF" in f["message"] and "layers.1.engram.embed" in (f["tensor"] + f["message"])
               for f in _errors(run)), _errors(run)


def _unindex_draft(ckpt: Path) -> None:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != DRAFT}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))


def test_a_source_whose_index_omits_its_draft_exports_it_indexed_and_excluded(draft_export, tmp_path):
    """Issue #49: a draft file in the source but not in its index was copied without exclude entries for its
    linears, and the export failed its own self-check (16 errors) after all the work. Its header says what it holds."""
    from quant.pipeline.run import quantize_checkpoint

    src, local = draft_export
    unindexed = Path(shutil.copytree(src, tmp_path / "src", ignore=shutil.ignore_patterns(".quant-*")))
    _unindex_draft(unindexed)
    out = tmp_path / "out"
    quantize_checkpoint(unindexed, out, log=lambda m: None)
    manifest, expected = (json.loads((d / "quant_manifest.json").read_text()) for d in (out, local))
    assert manifest["exclude"] == expected["exclude"]
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert {n for n, f in weight_map.items() if f == DRAFT} == set(read_header(src / DRAFT)[0])
    assert _verify(out).returncode == 0


def test_an_export_whose_index_omits_its_draft_is_a_named_failure(draft_export, tmp_path):
    """Issue #49: SGLang reads only the files an index names; an export whose index leaves the draft out passed."""
    _, out = draft_export
    broken = Path(shutil.copytree(out, tmp_path / "unindexed", ignore=shutil.ignore_patterns(".quant-*")))
    _unindex_draft(broken)
    run = _verify(broken)
    assert run.returncode == 1, run.stdout + run.stderr
    [error] = _errors(run)
    assert error["tensor"] == DRAFT and "lists none of its tensors" in error["message"], error


def test_a_run_stopped_while_copying_side_files_resumes_after_the_draft_changed(draft_export, tmp_path, monkeypatch):
    """Issue #49: a run killed while copying side files, rerun after the source's draft changed, refused its own
    earlier copy ("exists and was not written by this tool ... even with --overwrite"): the copy stood under its
    final name before it was recorded. Copies now go through OUT's scratch directory and are recorded first."""
    import torch
    from safetensors.torch import load_file, save_file

    from quant.pipeline.run import quantize_checkpoint

    src = Path(shutil.copytree(draft_export[0], tmp_path / "src"))
    out = tmp_path / "out"
    copy = shutil.copy2

    def stopped_after_a_copy(a, b, *args, **kwargs):
        copy(a, b, *args, **kwargs)
        if Path(a).name == "tokenizer.json":
            raise KeyboardInterrupt  # as a kill lands right after a side file's bytes are copied

    monkeypatch.setattr(shutil, "copy2", stopped_after_a_copy)
    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(src, out, log=lambda m: None)
    monkeypatch.undo()
    tensors = load_file(str(src / DRAFT))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + torch.ones_like(tensors[name])  # the source's draft changes
    save_file(tensors, str(src / DRAFT), metadata={"format": "pt"})
    quantize_checkpoint(src, out, log=lambda m: None)
    assert (out / DRAFT).read_bytes() == (src / DRAFT).read_bytes()
    assert _verify(out).returncode == 0


def test_a_draft_file_in_out_that_is_not_ours_is_refused_before_any_work(draft_export, tmp_path):
    """OUT holding a dspark.safetensors this tool did not write, even with --overwrite: exit 2 naming it, nothing
    written, the file kept (the draft was copied over it before: its name was not among those checked)."""
    src, _ = draft_export
    out = tmp_path / "out"
    out.mkdir()
    (out / DRAFT).write_bytes(b"someone else's draft")
    run = subprocess.run([sys.executable, "-m", "quant", "quantize", str(src), str(out), "--no-progress",
                          "--overwrite"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 2 and DRAFT in run.stderr and "not written by this tool" in run.stderr, run.stderr
    assert (out / DRAFT).read_bytes() == b"someone else's draft"
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [DRAFT]


# The draft's contents against SGLang 0.5.23's DSparkMiniMaxDraftModel (the family's `dspark` sidecar lists what it
# allocates; tests_engines/test_sglang_minimax_dspark.py checks the list against the class and its loader).
W1 = "language_model.model.dspark.markov_head.markov_w1.weight"
FC = "language_model.model.dspark.fc.weight"
CONFIDENCE = "language_model.model.dspark.confidence_head.proj.weight"


def _with_draft(ckpt: Path, out: Path, change) -> Path:
    """A copy of `ckpt` whose draft file's tensors are rewritten by `change(tensors)` (the index follows)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(ckpt, out)
    tensors = load_file(out / DRAFT)
    change(tensors)
    save_file(tensors, out / DRAFT, metadata={"format": "pt"})
    index_path = out / "model.safetensors.index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        index["weight_map"] = {**{k: v for k, v in index["weight_map"].items() if v != DRAFT},
                               **dict.fromkeys(tensors, DRAFT)}
        index_path.write_text(json.dumps(index))
    return out


DRAFT_DAMAGE = {  # case -> (change, the tensor named, what the line says)
    "missing": (lambda t: t.pop(W1), W1, "has no"),
    "shape": (lambda t: t.update({FC: t[FC][:, :-32].clone()}), FC, "[160, 288] but"),
    "dtype": (lambda t: t.update({FC: t[FC].to(torch.float8_e4m3fn)}), FC, "F8_E4M3"),
    "unexpected": (lambda t: t.update({FC.replace("fc", "fc2"): t[FC].clone()}), FC.replace("fc", "fc2"),
                   "no parameter"),
}


@pytest.mark.parametrize("case", sorted(DRAFT_DAMAGE))
def test_a_draft_the_draft_class_cannot_load_is_refused_by_quantize_and_the_preflight(draft_export, tmp_path, case):
    from quant.errors import QuantError
    from quant.pipeline.run import quantize_checkpoint
    from quant.verify import verify_checkpoint

    change, tensor, says = DRAFT_DAMAGE[case]
    src, out = draft_export
    damaged_src = _with_draft(src, tmp_path / "src", change)
    with pytest.raises(QuantError) as caught:
        quantize_checkpoint(damaged_src, tmp_path / "out", check_engines=[], log=lambda *a: None)
    assert caught.value.exit_code == 2 and tensor in str(caught.value) and says in str(caught.value)
    assert not (tmp_path / "out").exists()
    report = verify_checkpoint(_with_draft(out, tmp_path / "export", change), named=set())
    drafts = [f for f in report.errors if "draft class" in f.message]  # other rules may name it too (shapes)
    assert [f.tensor for f in drafts] == [tensor], [f.message for f in report.errors]


def test_the_draft_confidence_head_is_optional_as_sglang_skips_it(draft_export, tmp_path):
    """SGLang's static verify mode (M3.1's) builds no confidence head and its loader skips the tensors."""
    from quant.verify import verify_checkpoint

    _, out = draft_export
    trimmed = _with_draft(out, tmp_path / "export",
                          lambda t: [t.pop(n) for n in list(t) if ".confidence_head." in n])
    assert CONFIDENCE not in read_header(trimmed / DRAFT)[0]
    assert not verify_checkpoint(trimmed, named=set()).errors


def test_the_draft_preflight_cli_names_the_missing_tensor(draft_export, tmp_path):
    _, out = draft_export
    run = _verify(_with_draft(out, tmp_path / "export", lambda t: t.pop(W1)))
    assert run.returncode == 1 and [e["tensor"] for e in _errors(run)] == [W1], run.stdout[-2000:]
