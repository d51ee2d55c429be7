"""A user's files are sacred, as a hostile tester would check it: random trees of user files, symlinks (to files,
to directories, to the home directory, to the source, loops, dangling), forged owner records and flag
combinations, for every command that writes (toy, quantize, eval --out, eval --card, verify-manifest --fix).
After every run, whatever it returned, every user file is byte-identical (a symlink still points where it did)
and every input is untouched; a run either succeeds or refuses with the table's exit code (2, or 74 for the
machine), never an internal error.

`QUANT_OWNERSHIP_CASES` sets the number of random worlds (default 24, a few seconds each);
`scripts/fuzz_ownership.py` runs many more."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import pytest

from quant.errors import QuantError

CASES = int(os.environ.get("QUANT_OWNERSHIP_CASES", "24"))
BASE_SEED = int(os.environ.get("QUANT_OWNERSHIP_SEED", "0"))
TRAINED_TOY = Path(__file__).parent.parent / "evals" / "data" / "toy_arith" / "model"
# Names our commands write, and names users pick that look like our scratch: the collisions that matter.
TEMPTING = ["README.md", "report.md", "report.json", "config.json", "model.safetensors", "tokenizer.json",
            "runs/keep.txt", "runs/candidate/toy_arith/samples.jsonl", "work/notes", "data/x.jsonl", "tasks/t.yaml",
            "hf_datasets_cache/c", "notes.txt", "model.safetensors.tmp", ".tmpAb12Cd", "session.tmp",
            "quant_manifest.json", "eval_report.png", "model.safetensors.index.json"]


def snapshot(root: Path) -> dict[str, tuple[str, str]]:
    """Every entry under `root`, symlinks as links (never followed): path -> (kind, content or target)."""
    entries = {}
    for parent, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(parent) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                entries[rel] = ("link", os.readlink(path))
            elif path.is_file():
                entries[rel] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
            elif path.is_dir():
                entries[rel] = ("dir", "")
    return entries


def subtree(entries: dict, top: str) -> dict:
    """The entries under `top`, less the caches libraries keep in a home directory by design (matplotlib's font
    list, the hub's cache: `~/.cache`, `~/.config`), which are not this tool's writes."""
    caches = (f"{top}/.cache", f"{top}/.config")
    return {k: v for k, v in entries.items() if (k == top or k.startswith(top + "/"))
            and not any(k == c or k.startswith(c + "/") for c in caches)}


class World:
    """A home directory, a source checkpoint, a victim directory beside OUT, and OUT in some random state."""

    def __init__(self, root: Path, rng: random.Random, source: Path):
        self.root, self.rng = root, rng
        self.home = root / "home"
        self.victim = root / "victim"
        self.src = root / "src"
        home = rng.choice([["config.json", "session.tmp", "work/keep.txt"], ["notes/today.txt"]])
        for d, names in ((self.home, home),
                         (self.victim, ["precious.txt", "README.md", "sub/deep.bin"])):
            for name in names:
                (d / name).parent.mkdir(parents=True, exist_ok=True)
                (d / name).write_bytes(rng.randbytes(rng.randint(1, 64)))
        # A checkpoint as a user holds it (downloaded, or copied without this tool's bookkeeping): not ours.
        shutil.copytree(source, self.src, ignore=shutil.ignore_patterns(".quant-*"))
        self.out = root / "out"
        self.make_out()

    def make_out(self) -> None:
        rng, out = self.rng, self.out
        shape = rng.choice(["new", "empty", "user", "user", "user", "link-home", "link-home", "link-src", "link-src",
                            "link-victim", "link-new", "dangling", "loop", "link-parent", "forged", "forged"])
        if shape == "empty":
            out.mkdir()
        elif shape == "user":
            out.mkdir()
            for name in rng.sample(TEMPTING, rng.randint(1, 5)):
                (out / name).parent.mkdir(parents=True, exist_ok=True)
                (out / name).write_bytes(rng.randbytes(rng.randint(1, 32)))
            for _ in range(rng.randint(0, 3)):
                self.add_link(out / rng.choice(["link", "README.md", "runs", "work", "data", "config.json",
                                                ".quant-tmp", "model.safetensors"]))
            if rng.random() < 0.5:
                self.forge_record()
        elif shape == "forged":
            out.mkdir()
            self.forge_record()
        elif shape == "link-home":
            out.symlink_to(self.home)
        elif shape == "link-src":
            out.symlink_to(self.src)
        elif shape == "link-victim":
            out.symlink_to(self.victim)
        elif shape == "link-new":
            out.symlink_to(self.root / "elsewhere")
            (self.root / "elsewhere").mkdir()
        elif shape == "dangling":
            out.symlink_to(self.root / "nowhere")
        elif shape == "loop":
            out.symlink_to(out)
        elif shape == "link-parent":  # OUT spelled through `..` into the source
            self.out = self.root / "victim" / ".." / "src"

    def add_link(self, at: Path) -> None:
        if os.path.lexists(at):
            return
        at.parent.mkdir(parents=True, exist_ok=True)
        target = self.rng.choice([self.home, self.victim, self.victim / "precious.txt", self.src,
                                  self.src / "config.json", self.root / "nowhere", at])
        at.symlink_to(target)

    def forged_entry(self, name: str) -> list:
        """A file entry with the true size and sha256 of what the name reaches when it points outside OUT (as a
        forger could write it: then only the name check stands in the way), else made-up ones."""
        target = Path(name) if name.startswith("/") else self.out / name
        inside = not name.startswith("/") and ".." not in name.split("/")
        if not inside and target.is_file():
            data = target.read_bytes()
            return [len(data), hashlib.sha256(data).hexdigest()]
        return [self.rng.randint(0, 99), hashlib.sha256(name.encode()).hexdigest()]

    def forge_record(self) -> None:
        """An owner record naming files outside OUT, or a user's file, as ours."""
        rng = self.rng
        names = rng.sample(["../victim/precious.txt", str(self.victim / "README.md"), "../victim/sub/deep.bin",
                            "runs/../../victim/precious.txt", "../victim", "/etc/hostname", "README.md",
                            "./config.json", "link", "runs/keep.txt"], 4)
        kind = rng.choice(["toy", "toy", "quantize", "eval"])
        if rng.random() < 0.25:  # the record of an earlier version: names only
            record = {"tool": "moe-quant", "kind": kind, "identity": None, "written": names}
        else:
            files = {n: self.forged_entry(n) for n in names}
            record = {"tool": "moe-quant", "version": 2, "kind": kind, "identity": None, "files": files,
                      "dirs": rng.sample(names, 2)}
        (self.out / ".quant-owner.json").write_text(json.dumps(record))


def run_command(world: World, rng: random.Random, command: str) -> set[Path]:
    """One writing command on the world's OUT, with random flags, through the same code the CLI runs. Returns
    what the user allowed it to replace: the file `verify-manifest --fix PATH --overwrite` names."""
    overwrite = rng.random() < 0.6
    out = world.out
    if command == "toy":
        from quant.commands.toy import write_toy

        write_toy(rng.choice(["qwen3-moe", "glm5"]), out, seed=rng.randint(0, 1), overwrite=overwrite)
    elif command == "quantize":
        from quant.pipeline import quantize_checkpoint

        quantize_checkpoint(world.src, out, scheme=rng.choice(["w_mxfp4_a_mxfp4", "fp8"]), check_engines=None,
                            overwrite=overwrite, log=lambda m: None)
    elif command == "eval":
        from evals.compare import EvalRequest, evaluate

        evaluate(EvalRequest(candidate=str(world.src), baseline=str(TRAINED_TOY), out=out, tasks="toy_arith",
                             limit=2, max_gen_toks=4, seeds=1, dtype="float32", overwrite=overwrite,
                             mtp=False), log=lambda m: None)
    elif command == "card":
        from evals.report.card import add_accuracy

        report_dir = world.root / "report-dir"
        report_dir.mkdir(exist_ok=True)
        add_accuracy(out, {"verdict": "pass", "margin_points": 2.0, "baseline": {"name": "fp8"}, "rows": []},
                     report_dir)
    elif command == "fix":
        from quant.commands.verify import check_fix_target
        from quant.verify import fix_config

        ckpt = rng.choice([world.src, out])
        target = rng.choice([out / "config.fixed.json", out / "README.md", out, world.src / "model.safetensors",
                             world.victim / "precious.txt", world.root / "fixed.json"])
        check_fix_target(Path(ckpt), Path(target), overwrite)
        fix_config(ckpt, target)
        return {Path(target)} if overwrite else set()
    return set()


def world_cases():
    return [BASE_SEED + i for i in range(CASES)]


@pytest.fixture(scope="module")
def quantized_source(tmp_path_factory, toy_factory):
    """The trained toy quantized once (an export of ours, so eval and --card have a real candidate)."""
    from quant.pipeline import quantize_checkpoint

    out = tmp_path_factory.mktemp("prop") / "arith-mxfp4"
    quantize_checkpoint(TRAINED_TOY, out, check_engines=None, log=lambda m: None)
    return out


@pytest.mark.parametrize("seed", world_cases())
def test_no_command_loses_a_user_file(seed, tmp_path, monkeypatch, quantized_source):
    rng = random.Random(seed)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    world = World(tmp_path, rng, quantized_source)
    before = snapshot(tmp_path)
    commands = rng.choices(["toy", "quantize", "eval", "card", "fix"], weights=[3, 3, 1, 2, 2], k=rng.randint(1, 2))
    written = set()
    for command in commands:
        try:
            allowed = run_command(world, rng, command)
            written |= {str(p.relative_to(tmp_path)) for p in allowed if p.is_relative_to(tmp_path)}
        except QuantError as e:
            assert e.exit_code == 2, f"{command}: {e}"
        except OSError as e:  # the CLI's exit 74: only the machine's own failures, never one of ours
            pytest.fail(f"{command}: OSError {e}")
        after = snapshot(tmp_path)
        for rel, entry in before.items():
            if rel in written:
                continue
            assert after.get(rel) == entry, f"seed {seed}, {command}: {rel} was {entry}, now {after.get(rel)}"
        # The home directory, and the source of a command that reads it, gain nothing either: refused outright.
        assert subtree(after, "home") == subtree(before, "home"), f"seed {seed}, {command}: wrote into the home"
        if command in ("quantize", "eval"):
            assert subtree(after, "src") == subtree(before, "src"), f"seed {seed}, {command}: wrote into its input"
        # What this command added is its own (a later command of the same world may replace it).
        written |= set(after) - set(before)
