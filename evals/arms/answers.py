"""Every answer an arm gets is kept as it arrives, so an eval that was interrupted (Ctrl-C, a crash, a kill, a
server restart) and is run again asks only what is missing and ends with the report of an uninterrupted run.

The store is one SQLite file per arm in the eval's scratch directory (OUT/.quant-eval/answers/ARM.sqlite), one
row per answer, committed as it arrives (a server's answer on its own, in process a batch at a time; WAL journal:
a killed process loses only what it had not yet committed, never a committed row, and never leaves half a row).
SGLang's acceptance replays (evals.replay) are kept in the same store under their own request type. lm-eval's own
request cache
(`use_cache`, `lm_eval.api.model.CachingLM`) is not used: it keys a request by its arguments alone (whatever model
answered it), skips every sampled request (GPQA's seeded generations) and writes through a background thread.

A row's key is sha256 over (the arm's identity, the request type, the prompt as sent (the text, or the chat
messages), the generation settings lm-eval passes (stop strings, max tokens, do_sample, temperature, top_p, the
server seed) and the run's generation seed). The identity is
- a checkpoint in process: `checkpoint_digest`, the sha256 of every top-level file's name and full content, the
  shards' every byte included (never a file's size or modification time: a shard rewritten in place with its old
  modification time put back is another model, and reuses nothing), with the dtype, device, batch size and the
  torch, transformers and lm-eval versions. A checkpoint is hashed once per eval run (`digests_for_this_run`, by
  path, kept only while that run lasts: the next run hashes it again);
- a server: the endpoint URL, the model id sent, and what GET /models says of it (`root`, `max_model_len`, and a
  `checkpoint_digest` where the server reports one, as evals.arms.model_server does), with the lm-eval version;
  without a reported digest, the server is known only by what the user names (its URL and model id).
A changed model, prompt, few-shot example or setting therefore changes the key: nothing is reused (tests:
tests/test_eval_resume.py, tests/test_eval_identity.py). Failed generations are never kept (they are asked again).
Each arm's identity is also written beside its samples (runs/ARM/identity.json), so that a later `--baseline-run`
knows which model gave the answers it reuses (`same_model`: a model is never compared with its own answers).

In process, answers arrive a batch at a time and are committed a whole batch at a time, so what was kept is
always whole batches from the front of lm-eval's order and the rest is batched exactly as an uninterrupted run
batches it (padding, hence bf16 rounding, depends on the batch). Sampled generations in process draw from a
torch seed derived from the run's seed and the batch's prompts, not from the position in the run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sqlite3
import threading
import urllib.request
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from evals.arms.backends import FAILED_GENERATION, Backend, api_root
from quant.errors import QuantError
from quant.files import sha256_file

ANSWERS_DIR = "answers"
IDENTITY_FILE = "identity.json"  # each arm's identity, beside its samples (runs/ARM/identity.json)


def _versions(*names: str) -> dict:
    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


_run_digests: dict | None = None  # path -> (the files' stat signature, digest), while an eval run lasts
_run_digests_lock = threading.Lock()


@contextlib.contextmanager
def digests_for_this_run():
    """While the block runs, `checkpoint_digest` hashes each checkpoint (by resolved path) once: the self-comparison
    check and the arm's answer store share one hash. Nothing is kept past the block: every run hashes afresh."""
    global _run_digests
    with _run_digests_lock:
        outer = _run_digests
        if outer is None:
            _run_digests = {}
    try:
        yield
    finally:
        with _run_digests_lock:
            _run_digests = outer


def _checkpoint_files(path: Path) -> list[Path]:
    return [entry for entry in sorted(Path(path).iterdir(), key=lambda p: p.name)
            if entry.is_file() and not entry.name.startswith(".quant-")]


def _signature(files: list[Path]) -> tuple:
    """Within one run only: a file changed since it was hashed there (a new size, inode, modification or status
    change time; the last is set by every write and by `os.utime` itself) is hashed again. Never a reason to skip
    hashing across runs: there the bytes are hashed whatever the signature says."""
    out = []
    for f in files:
        st = f.stat()
        out.append((f.name, st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(out)


def checkpoint_digest(path: Path) -> str:
    """sha256 identifying a checkpoint directory's contents: every top-level file's name and the sha256 of its full
    content, shards included (the bytes, never a size or modification time, so a shard rewritten in place with its
    modification time put back gets a new digest). Within `digests_for_this_run`, a checkpoint is hashed once."""
    files = _checkpoint_files(path)
    key = str(Path(path).resolve())
    signature = _signature(files)
    with _run_digests_lock:
        cached = _run_digests.get(key) if _run_digests is not None else None
    if cached is not None and cached[0] == signature:
        return cached[1]
    h = hashlib.sha256()
    for entry in files:
        h.update(entry.name.encode() + b"\0" + bytes.fromhex(sha256_file(entry)) + b"\0")
    digest = h.hexdigest()
    with _run_digests_lock:
        if _run_digests is not None:
            _run_digests[key] = (signature, digest)
    return digest


def _model_entry(url: str, model: str, timeout: float = 30.0) -> dict:
    """What the server's GET /models says of `model` (its id, root, max_model_len, checkpoint_digest)."""

    try:
        with urllib.request.urlopen(f"{api_root(url)}/models", timeout=timeout) as response:
            data = json.load(response)
        entries = [m for m in data.get("data") or [] if isinstance(m, dict) and str(m.get("id")) == model]
    except (OSError, ValueError, AttributeError):
        entries = []
    entry = entries[0] if entries else {}
    return {k: entry.get(k) for k in ("root", "max_model_len", "checkpoint_digest") if entry.get(k) is not None}


def server_identity(url: str, model: str) -> dict:
    """A server arm's model: the URL and model id the user named, and what GET /models says of it."""
    return {"kind": "server", "url": url, "model": model, **_model_entry(url, str(model))}


def arm_identity(backend: Backend, options) -> dict:
    """What answered: the key every kept answer of the arm carries."""
    if backend.kind == "server":
        model = getattr(backend.lm, "model", None)
        url = getattr(backend.lm, "base_url", backend.source)
        return {**server_identity(url, model), **_versions("lm_eval")}
    return {"kind": "transformers", "checkpoint_digest": checkpoint_digest(Path(backend.source)),
            "dtype": options.dtype, "device": str(getattr(backend.lm, "device", options.device)),
            "batch_size": options.batch_size, "activations": backend.activations,
            **_versions("torch", "transformers", "lm_eval")}


def same_model(a: dict, b: dict) -> bool:
    """Whether two arm identities are one model: in process, the same checkpoint bytes (whatever the dtype, device
    or batch size it ran with); servers, the same `checkpoint_digest` where both report one, else the same API root
    and model id (all that is known of a server that reports no digest). An in-process arm and a server are never
    the same here: comparing a checkpoint with an engine serving it is a check of that engine."""
    if a.get("kind") != b.get("kind"):
        return False
    if a.get("kind") == "transformers":
        return bool(a.get("checkpoint_digest")) and a.get("checkpoint_digest") == b.get("checkpoint_digest")
    if a.get("checkpoint_digest") and b.get("checkpoint_digest"):
        return a["checkpoint_digest"] == b["checkpoint_digest"]
    return bool(a.get("url")) and api_root(str(a.get("url"))) == api_root(str(b.get("url"))) and \
        a.get("model") == b.get("model")


def write_identity(run_dir: Path, identity: dict) -> None:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / IDENTITY_FILE).write_text(json.dumps(identity, sort_keys=True, indent=1) + "\n")


def read_identity(run_dir: Path) -> dict | None:
    """The identity an earlier run wrote beside an arm's samples; None where it wrote none (before there was one)."""
    path = Path(run_dir) / IDENTITY_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise QuantError(f"{path}: unreadable ({' '.join(str(e).split())[:200]})") from None
    if not isinstance(data, dict):
        raise QuantError(f"{path}: not an arm identity (a JSON object)")
    return data


def _plain(value):
    """A prompt as JSON: lm-eval's chat prompts (JsonChatStr) by their messages, tagged apart from plain text."""
    prompt = getattr(value, "prompt", None)
    if isinstance(prompt, str):
        return {"chat": prompt}
    raise TypeError(f"cannot key a request argument of type {type(value).__name__}")


def request_key(identity_digest: str, attr: str, args, seed: int) -> str:
    text = json.dumps([identity_digest, attr, list(args), seed], sort_keys=True, default=_plain,
                      ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


class AnswerStore:
    """One arm's kept answers: `get(key)`, `put(key, response)` (buffered), `commit()` (one transaction)."""

    def __init__(self, path: Path, identity: dict):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.identity = identity
        self.digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")  # a committed row survives a killed process
        self.db.execute("CREATE TABLE IF NOT EXISTS answers (key TEXT PRIMARY KEY, identity TEXT NOT NULL, "
                        "response TEXT NOT NULL)")
        self.db.execute("CREATE TABLE IF NOT EXISTS identities (digest TEXT PRIMARY KEY, identity TEXT NOT NULL)")
        self.db.execute("INSERT OR IGNORE INTO identities VALUES (?, ?)", (self.digest, json.dumps(identity)))
        self.lock = threading.Lock()
        self.pending: list[tuple[str, str]] = []
        self.kept = self.asked = 0

    def get(self, key: str) -> str | None:
        with self.lock:
            row = self.db.execute("SELECT response FROM answers WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def put(self, key: str, response: str) -> None:
        with self.lock:
            self.pending.append((key, response))

    def commit(self) -> None:
        with self.lock:
            if not self.pending:
                return
            self.db.execute("BEGIN")
            self.db.executemany("INSERT OR REPLACE INTO answers VALUES (?, ?, ?)",
                                [(k, self.digest, r) for k, r in self.pending])
            self.db.execute("COMMIT")
            self.pending.clear()

    def count(self) -> int:
        with self.lock:
            return self.db.execute("SELECT COUNT(*) FROM answers").fetchone()[0]

    def close(self) -> None:
        self.commit()
        self.db.close()


class _Hook:
    """lm-eval's cache hook (`lm.set_cache_hook`): each LM calls `add_partial` as each answer arrives."""

    def __init__(self, store: AnswerStore, seed: int, batched: bool):
        self.store, self.seed, self.batched = store, seed, batched

    def add_partial(self, attr, req, res) -> None:
        if attr != "generate_until" or not isinstance(res, str) or res == FAILED_GENERATION:
            return
        self.store.put(request_key(self.store.digest, attr, req, self.seed), res)
        if not self.batched:
            self.store.commit()


def _seeded_batches(lm, store: AnswerStore, seed: int, sampled: bool):
    """Wrap the in-process LM's batch generation: commit the previous batch's answers before the next batch
    starts (whole batches only), and seed a sampled batch from the run's seed and its prompts."""
    generate = lm._model_generate

    def model_generate(context, *args, **kwargs):
        store.commit()
        if sampled:
            import torch

            digest = hashlib.sha256(context.cpu().numpy().tobytes() + str(seed).encode()).digest()
            torch.manual_seed(int.from_bytes(digest[:8], "little") & (2 ** 63 - 1))
        return generate(context, *args, **kwargs)

    return model_generate


@contextlib.contextmanager
def kept_answers(backend: Backend, store: AnswerStore, seed: int, sampled: bool, log=print):
    """While the block runs, the backend's LM answers `generate_until` from the store where it can and asks the
    model only for the rest, keeping each new answer as it arrives."""
    from lm_eval.api.model import CacheHook

    lm = backend.lm
    batched = backend.kind != "server"
    hook = _Hook(store, seed, batched)
    original = lm.generate_until

    def generate_until(requests, *args, **kwargs):
        keys = [request_key(store.digest, "generate_until", r.args, seed) for r in requests]
        answers = [store.get(k) for k in keys]
        missing = [r for r, a in zip(requests, answers) if a is None]
        store.kept += len(requests) - len(missing)
        store.asked += len(missing)
        if len(missing) < len(requests):
            log(f"  {backend.label}: {len(requests) - len(missing)} answers kept from an earlier run, "
                f"{len(missing)} to ask")
        fresh = iter(original(missing, *args, **kwargs) if missing else [])
        store.commit()
        return [a if a is not None else next(fresh) for a in answers]

    lm.set_cache_hook(hook)
    lm.generate_until = generate_until
    if batched:
        lm._model_generate = _seeded_batches(lm, store, seed, sampled)
    try:
        yield store
    finally:
        store.commit()
        for name in ("generate_until", "_model_generate"):
            lm.__dict__.pop(name, None)
        lm.set_cache_hook(CacheHook(None))


def answers_path(scratch: Path, label: str) -> Path:
    return Path(scratch) / ANSWERS_DIR / f"{label}.sqlite"


def open_store(scratch: Path, backend: Backend, options) -> AnswerStore:
    """The arm's store in the eval's scratch; anything but a regular file where it lives (a link is never
    written through) is removed first, with the SQLite journal files beside it."""
    path = answers_path(scratch, backend.label)
    for name in (path.name, path.name + "-wal", path.name + "-shm"):
        entry = path.parent / name
        if os.path.islink(entry) or (os.path.lexists(entry) and not entry.is_file()):
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    identity = arm_identity(backend, options)
    try:
        return AnswerStore(path, identity)
    except sqlite3.DatabaseError:  # not a database (a damaged or foreign file): its answers cannot be trusted
        for name in (path.name, path.name + "-wal", path.name + "-shm"):
            (path.parent / name).unlink(missing_ok=True)
        return AnswerStore(path, identity)

