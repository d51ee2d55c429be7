"""`quant quantize` under crashes and bad input: resume to identical bytes, one-line errors, nothing that looks
complete, never a write into the source."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quant.errors import QuantError
from quant.pipeline import COMPLETE_MARKER, quantize_checkpoint
from quant.pipeline import execute

from test_quantize import tree_hashes

QUANT = [sys.executable, "-m", "quant.cli"]


@pytest.fixture
def sharded(toy_factory):
    return toy_factory("glm5", shard_size=300_000)


def test_resume_after_a_crash_gives_identical_bytes(sharded, tmp_path, monkeypatch):
    clean = tmp_path / "clean"
    quantize_checkpoint(sharded, clean)
    assert len(list(clean.glob("model-*.safetensors"))) >= 3

    real = execute.run_shard
    calls = []

    def crash_on_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("simulated crash")
        return real(*args, **kwargs)

    resumed = tmp_path / "resumed"
    monkeypatch.setattr("quant.pipeline.run.run_shard", crash_on_third)
    with pytest.raises(RuntimeError):
        quantize_checkpoint(sharded, resumed)
    assert not (resumed / COMPLETE_MARKER).exists() and not (resumed / "config.json").exists()
    monkeypatch.setattr("quant.pipeline.run.run_shard", real)

    done_before = {p.name: p.stat().st_mtime_ns for p in resumed.glob("*.safetensors")}
    assert len(done_before) == 2
    stray = resumed / ".quant-tmp" / sorted(clean.glob("model-*.safetensors"))[2].name
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(b"half-written garbage")  # what a kill during save leaves behind (in our own scratch)
    redo = []
    monkeypatch.setattr("quant.pipeline.run.run_shard", lambda *a, **k: redo.append(a[2].file) or real(*a, **k))
    quantize_checkpoint(sharded, resumed)
    assert not set(redo) & set(done_before), "finished shards must be skipped"
    assert not stray.exists()
    assert tree_hashes(resumed) == tree_hashes(clean)


def test_a_shard_whose_bytes_changed_is_never_overwritten_and_is_redone_once_moved(sharded, tmp_path, monkeypatch):
    """A shard that no longer holds what this tool wrote is not ours (quant.ownership): the re-run refuses it in
    one line, even with --overwrite; once it is moved away the re-run redoes that shard alone."""
    out = tmp_path / "q"
    quantize_checkpoint(sharded, out)
    reference = tree_hashes(out)
    victim = sorted(out.glob("model-*.safetensors"))[1]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    for overwrite in (False, True):
        with pytest.raises(QuantError, match=f"{victim.name}: exists and was not written by this tool") as e:
            quantize_checkpoint(sharded, out, overwrite=overwrite)
        assert e.value.exit_code == 2 and victim.read_bytes() == bytes(data)
    victim.rename(tmp_path / "moved")
    redo = []
    real = execute.run_shard
    monkeypatch.setattr("quant.pipeline.run.run_shard", lambda *a, **k: redo.append(a[2].file) or real(*a, **k))
    quantize_checkpoint(sharded, out)
    assert redo == [victim.name]
    assert tree_hashes(out) == reference


def test_killed_process_resumes_to_identical_bytes(sharded, tmp_path):
    """A real SIGKILL mid-run (not an exception): the re-run finishes to the same bytes."""
    clean = tmp_path / "clean"
    subprocess.run(QUANT + ["quantize", str(sharded), str(clean), "--no-progress"], check=True,
                   capture_output=True)
    out = tmp_path / "killed"
    proc = subprocess.Popen(QUANT + ["quantize", str(sharded), str(out), "--no-progress"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if list((out / ".quant-progress").glob("*.json")) if (out / ".quant-progress").is_dir() else []:
            break
        time.sleep(0.01)
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    subprocess.run(QUANT + ["quantize", str(sharded), str(out), "--no-progress"], check=True, capture_output=True)
    assert tree_hashes(out) == tree_hashes(clean)


def test_ctrl_c_is_one_line_exit_130_and_resumable(sharded, tmp_path):
    """SIGINT mid-run: a one-line message and exit 130 (not typer's silent 130, not click's "Aborted!" exit 1),
    OUT visibly unfinished, and the same command finishes it to an uninterrupted run's bytes."""
    clean = tmp_path / "clean"
    quantize_checkpoint(sharded, clean, check_engines=None)
    out = tmp_path / "stopped"
    proc = subprocess.Popen(QUANT + ["quantize", str(sharded), str(out), "--no-progress", "--check-engines", ""],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if (out / ".quant-progress").is_dir() and list((out / ".quant-progress").glob("*.json")):
            break
        time.sleep(0.01)
    if proc.poll() is not None:
        pytest.skip("the run finished before the signal could be sent")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0 and (out / COMPLETE_MARKER).exists():
        # under load the poll above can wake after the last shard: the run was finishing when the signal came
        assert tree_hashes(out) == tree_hashes(clean)
        pytest.skip("the run finished before the signal arrived")
    assert proc.returncode == 130, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: interrupted"), err
    assert_not_complete(out)
    subprocess.run(QUANT + ["quantize", str(sharded), str(out), "--no-progress", "--check-engines", ""], check=True,
                   capture_output=True)
    assert tree_hashes(out) == tree_hashes(clean)


def _file_size_limit(nbytes: int):
    """For subprocess preexec_fn: writes past `nbytes` fail with EFBIG, the same failed-write path as a full disk
    (SIGXFSZ ignored, as a shell's `ulimit -f` does not; it would otherwise kill the process)."""
    import resource

    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))

    return apply


def test_a_write_that_fails_is_one_line_exit_74_and_resumes(sharded, tmp_path, full_disk):
    """Disk full (a real 1 MiB tmpfs where root can mount one) and a file-size limit (everywhere): one line
    naming the file, exit 74 (I/O error, not a verdict), no config.json, and the same command finishes the
    output to an uninterrupted run's bytes once there is room."""
    clean = tmp_path / "clean"
    quantize_checkpoint(sharded, clean)  # the CLI's default self-check, recorded in the manifest and card
    shard_bytes = min(p.stat().st_size for p in clean.glob("*.safetensors"))
    out = tmp_path / "limited"
    proc = subprocess.run(QUANT + ["quantize", str(sharded), str(out), "--no-progress"], capture_output=True,
                          text=True, preexec_fn=_file_size_limit(shard_bytes // 2), timeout=300)
    assert proc.returncode == 74, proc.stderr
    assert_one_line_error(proc, str(out), "File too large")
    assert_not_complete(out)
    subprocess.run(QUANT + ["quantize", str(sharded), str(out), "--no-progress"], check=True, capture_output=True)
    assert tree_hashes(out) == tree_hashes(clean)
    if full_disk is not None:
        proc = run_cli("quantize", sharded, full_disk / "out")
        assert proc.returncode == 74, proc.stderr
        assert_one_line_error(proc, str(full_disk / "out"), "No space left on device")
        assert_not_complete(full_disk / "out")


def test_a_read_only_output_is_one_line(sharded, tmp_path):
    """A read-only file system (root: a read-only tmpfs; others: a directory without write permission)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = os.geteuid() == 0 and not subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs",
                                                        str(ro)], capture_output=True).returncode
    if not mounted:
        if os.geteuid() == 0:
            pytest.skip("root writes through permissions and cannot mount here")
        ro.chmod(0o555)
    try:
        proc = run_cli("quantize", sharded, ro / "out")
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(ro)], capture_output=True)
    assert proc.returncode == 74
    assert_one_line_error(proc, str(ro / "out"), "Read-only file system" if mounted else "Permission denied")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _mutate_tensor(ckpt: Path, name: str, fn):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shard = ckpt / index["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = fn(tensors[name])
    save_file(tensors, shard, metadata={"format": "pt"})


def _first(ckpt: Path, contains: str) -> str:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    return next(n for n in sorted(index["weight_map"]) if contains in n)


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(QUANT + list(map(str, args)) + ["--no-progress"], capture_output=True, text=True)


def assert_one_line_error(proc, *needles):
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert "Traceback" not in err, err
    lines = [l for l in err.splitlines() if l.startswith("error:")]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], lines[0]


def assert_not_complete(out: Path):
    assert not (out / COMPLETE_MARKER).exists()
    assert not (out / "config.json").exists()


def test_truncated_shard(sharded, tmp_path):
    src = _copy(sharded, tmp_path / "src")
    shard = sorted(src.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    proc = run_cli("quantize", src, tmp_path / "out")
    assert_one_line_error(proc, shard.name)
    assert_not_complete(tmp_path / "out")


def test_corrupt_header(sharded, tmp_path):
    src = _copy(sharded, tmp_path / "src")
    shard = sorted(src.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[8:20] = b"{not json!!!"
    shard.write_bytes(bytes(data))
    assert_one_line_error(run_cli("quantize", src, tmp_path / "out"), shard.name)


@pytest.mark.parametrize("defect", ["missing-file", "missing-tensor", "escaping-path"])
def test_bad_index(sharded, tmp_path, defect):
    src = _copy(sharded, tmp_path / "src")
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = sorted(index["weight_map"])[5]
    if defect == "missing-file":
        index["weight_map"][name] = "model-99999-of-99999.safetensors"
        needle = "model-99999-of-99999.safetensors"
    elif defect == "missing-tensor":
        index["weight_map"]["model.layers.0.mlp.ghost_proj.weight"] = index["weight_map"][name]
        needle = "model.layers.0.mlp.ghost_proj.weight"
    else:
        (tmp_path / "outside.safetensors").write_bytes((src / index["weight_map"][name]).read_bytes())
        index["weight_map"][name] = "../outside.safetensors"
        needle = "../outside.safetensors"
    index_path.write_text(json.dumps(index))
    assert_one_line_error(run_cli("quantize", src, tmp_path / "out"), needle)
    assert_not_complete(tmp_path / "out")


def test_non_finite_weight_names_the_tensor(sharded, tmp_path):
    src = _copy(sharded, tmp_path / "src")
    name = _first(src, "mlp.experts.2.up_proj.weight")

    def poison(t):
        t = t.clone()
        t[0, 3] = float("nan")
        t[1, 0] = float("inf")
        return t

    _mutate_tensor(src, name, poison)
    before = tree_hashes(src)
    proc = run_cli("quantize", src, tmp_path / "out")
    assert_one_line_error(proc, name, "2")
    assert_not_complete(tmp_path / "out")
    assert tree_hashes(src) == before


def test_input_dim_not_multiple_of_32(sharded, tmp_path):
    src = _copy(sharded, tmp_path / "src")
    name = _first(src, "mlp.experts.0.down_proj.weight")
    _mutate_tensor(src, name, lambda t: t[:, : t.shape[1] - 8].contiguous())
    # The CLI stops at the config consistency check: the engines size this expert from config.json.
    assert_one_line_error(run_cli("quantize", src, tmp_path / "out"), name, "from config.json")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("*.safetensors"))
    # The planner's own rule, for a weight no config formula sizes: MX blocks run along the input dim.
    from quant.checkpoint import open_checkpoint
    from quant.errors import QuantError
    from quant.planning.plan import make_plan
    from quant.planning.recipes import family_for_config, load_recipe
    from quant.planning.schemes import get_scheme

    ckpt = open_checkpoint(src)
    with pytest.raises(QuantError, match=f"{name}.*multiple of 32"):
        make_plan(ckpt, family_for_config(ckpt.config, src / "config.json"), load_recipe(None),
                  get_scheme("w_mxfp4_a_mxfp4"), "even")


def test_unknown_dtype(sharded, tmp_path):
    src = _copy(sharded, tmp_path / "src")
    name = _first(src, "mlp.experts.0.gate_proj.weight")
    _mutate_tensor(src, name, lambda t: t.to(torch.int64))
    assert_one_line_error(run_cli("quantize", src, tmp_path / "out"), name, "I64")


@pytest.mark.parametrize("key", ["model_type", "num_hidden_layers"])
def test_config_without_required_fields(sharded, tmp_path, key):
    src = _copy(sharded, tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    del cfg[key]
    (src / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(run_cli("quantize", src, tmp_path / "out"), "config.json", key)


def test_declared_mtp_layer_missing(sharded, tmp_path):
    src = _copy(sharded, tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 2
    (src / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(run_cli("quantize", src, tmp_path / "out"), f"model.layers.{cfg['num_hidden_layers'] + 1}")


def test_output_inside_or_equal_to_source_is_refused(sharded, tmp_path):
    src = _copy(sharded, tmp_path / "src")
    before = tree_hashes(src)
    assert_one_line_error(run_cli("quantize", src, src), str(src))
    assert_one_line_error(run_cli("quantize", src, src / "q"), "inside")
    assert tree_hashes(src) == before


def test_unknown_scheme_recipe_and_offline_hub_id(sharded, tmp_path):
    assert_one_line_error(run_cli("quantize", sharded, tmp_path / "a", "--scheme", "nf4"), "nf4")
    assert_one_line_error(run_cli("quantize", sharded, tmp_path / "b", "--recipe", "everything"), "everything")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(QUANT + ["quantize", "zai-org/GLM-5", str(tmp_path / "c"), "--no-progress"],
                          capture_output=True, text=True, env=env)
    assert_one_line_error(proc, "zai-org/GLM-5", "offline")


def test_a_source_quantized_in_a_format_not_read_is_refused(sharded, tmp_path):
    """A Quark export is a source (tests/test_quark_sources.py); a quantization this tool cannot read (an int4
    AWQ config over plain weights) is refused in one line, not treated as BF16."""
    src = tmp_path / "awq"
    shutil.copytree(sharded, src)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (src / "config.json").write_text(json.dumps(config))
    assert_one_line_error(run_cli("quantize", src, tmp_path / "qq"), "already quantized")


def test_nonempty_foreign_output_dir_is_refused(sharded, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    assert_one_line_error(run_cli("quantize", sharded, out), str(out))
    assert (out / "precious.txt").read_text() == "keep me"


def test_several_workers_write_the_same_bytes_as_one(sharded, tmp_path):
    """Two CPU workers quantize and write their own shards; the output equals a single worker's, where the
    calling thread does the writing."""
    one, two = tmp_path / "one", tmp_path / "two"
    quantize_checkpoint(sharded, one)
    quantize_checkpoint(sharded, two, workers=2)
    # Every file is identical but the manifest's record of what ran.
    ones, twos = tree_hashes(one), tree_hashes(two)
    assert {k: v for k, v in twos.items() if k not in ("quant_manifest.json", ".quant-owner.json")} == \
        {k: v for k, v in ones.items() if k not in ("quant_manifest.json", ".quant-owner.json")}
    manifests = [json.loads((d / "quant_manifest.json").read_text()) for d in (one, two)]
    assert [m.pop("run") for m in manifests] == [{"devices": ["cpu"]}, {"devices": ["cpu", "cpu"]}]
    assert manifests[0] == manifests[1]


def test_a_second_run_into_the_same_out_is_refused_while_the_first_holds_it(sharded, tmp_path):
    from quant.errors import QuantError
    from quant.ownership import claim

    out = tmp_path / "q"
    with claim(out, "quantize"):  # a first run under way holds the lock
        with pytest.raises(QuantError, match="another quant command is writing into this directory"):
            quantize_checkpoint(sharded, out, check_engines=None)
    quantize_checkpoint(sharded, out, check_engines=None)  # free again: runs


def test_shards_are_readable_like_every_other_file(sharded, tmp_path):
    out = tmp_path / "q"
    quantize_checkpoint(sharded, out, check_engines=None)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir() if p.is_file() and not p.name.startswith(".")}
    assert len(set(modes.values())) == 1, modes


def test_a_foreign_directory_with_an_empty_progress_dir_is_not_taken(sharded, tmp_path):
    from quant.errors import QuantError

    out = tmp_path / "mine"
    (out / ".quant-progress").mkdir(parents=True)
    (out / "notes.txt").write_text("a user's file")
    with pytest.raises(QuantError, match="not an output of this tool"):
        quantize_checkpoint(sharded, out, check_engines=None)
    assert (out / "notes.txt").read_text() == "a user's file"


def test_a_rerun_keeps_files_with_temporary_looking_names_it_did_not_write(sharded, tmp_path):
    """Temporaries live in our own `.quant-tmp/`; a user's `*.tmp` or `.tmpXXXXXX` beside the shards is theirs."""
    clean, out = tmp_path / "clean", tmp_path / "out"
    quantize_checkpoint(sharded, clean, check_engines=None)
    quantize_checkpoint(sharded, out, check_engines=None)
    users = {".tmpAb12Cd": b"x" * 1000, "model-00001-of-00002.safetensors.tmp": b"y"}
    for name, data in users.items():
        (out / name).write_bytes(data)
    (out / ".quant-tmp").mkdir()
    (out / ".quant-tmp" / "model-00001-of-00002.safetensors").write_bytes(b"half")  # what a kill of ours leaves
    quantize_checkpoint(sharded, out, check_engines=None)
    assert {k: v for k, v in tree_hashes(out).items() if k not in users} == tree_hashes(clean)
    assert all((out / name).read_bytes() == data for name, data in users.items())


def test_os_errors_are_one_line(sharded, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = subprocess.run(QUANT + ["quantize", str(sharded), str(blocker / "out"), "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: ") and str(blocker) in proc.stderr


def _edit_in_place(shard: Path) -> None:
    """Change one weight's values of a source shard, its header and modification time kept (as `cp -p`, rsync or
    tar leave a rewritten file)."""
    from safetensors import safe_open

    st = shard.stat()
    with safe_open(str(shard), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(shard)
    name = next(n for n, t in sorted(tensors.items()) if n.endswith("proj.weight") and t.dim() == 2)
    tensors[name] = (tensors[name].float() * -3.0).to(tensors[name].dtype)
    save_file(tensors, shard, metadata=metadata)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_source_edited_after_the_run_is_read_again_by_its_bytes(sharded, tmp_path):
    """Bytes, not names: a finished export re-run after a source shard was edited in place (mtime kept) redoes the
    shards that read it; the export and its manifest are what the edited source gives from scratch."""
    src = tmp_path / "src"
    shutil.copytree(sharded, src)
    out = tmp_path / "out"
    quantize_checkpoint(src, out, check_engines=None)
    victim = sorted(src.glob("model-*.safetensors"))[1]
    _edit_in_place(victim)
    logs = []
    manifest = quantize_checkpoint(src, out, check_engines=None, log=logs.append)
    assert any("made again" in m and victim.name in m for m in logs), logs
    from quant.files import sha256_file

    assert manifest["source"]["shards"][victim.name]["sha256"] == sha256_file(victim)
    fresh = tmp_path / "fresh"
    quantize_checkpoint(src, fresh, check_engines=None)
    assert tree_hashes(out) == tree_hashes(fresh)
