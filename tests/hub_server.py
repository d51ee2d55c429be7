"""A Hugging Face Hub-compatible HTTP server on 127.0.0.1 for tests: the endpoints huggingface_hub's own client
calls for model_info, hf_hub_download and range reads, with the Hub's status codes and headers.

    server = HubServer().start()
    server.add_repo("org/good", folder)           # a local directory served as a model repository
    env = {"HF_ENDPOINT": server.url, ...}        # huggingface_hub reads HF_ENDPOINT when it is imported

Endpoints (as huggingface.co answers them, read from huggingface_hub 2.x: hf_api.model_info,
file_download.get_hf_file_metadata / hf_hub_download, utils/_http.hf_raise_for_status):

  GET /api/models/{repo}[/revision/{rev}][?blobs=true]  model info: id, sha, private, gated, siblings (with
                                                        size, blobId and lfs {sha256, size} when blobs=true)
  HEAD|GET /{repo}/resolve/{rev}/{path}                 a regular file: 200 with ETag (git blob id),
                                                        X-Repo-Commit, Content-Length, ranges;
                                                        an LFS file (*.safetensors): 302 to the storage origin's
                                                        /cdn/{sha256}?expires=G with X-Linked-Size,
                                                        X-Linked-Etag, X-Repo-Commit
  GET /api/models/{repo}/tree/{rev}[/{path}]           the file list (snapshot_download), one page
  GET /api/agent-harnesses                              huggingface_hub's telemetry registry (empty)
  HEAD|GET /cdn/{sha256}?expires=G                      the LFS blob, on a second port (another origin, as the
                                                        Hub's storage is): `Range: bytes=a-b` answered 206 with
                                                        Content-Range; 403 once the signed URL has expired

Uploads (read from huggingface_hub 2.x: hf_api.create_repo, upload_folder / create_commit with HF_HUB_DISABLE_XET=1,
_commit_api._fetch_upload_modes / _send_commit, lfs.post_lfs_batch_info / lfs_upload; the Hub's Xet storage is not
modelled, so a client with hf_xet must run with HF_HUB_DISABLE_XET=1):

  POST /api/repos/create                                {name, organization, visibility}: 200 {url} (the new
                                                        repository holds the Hub's `.gitattributes`), 409 if it
                                                        exists; 401 without a token
  POST /api/validate-yaml                               a README's front matter: 200, or 400 with errors
  POST /api/models/{repo}/preupload/{rev}               per file: uploadMode (lfs for LFS_SUFFIXES), shouldIgnore,
                                                        oid of the file the revision already holds
  POST /{repo}.git/info/lfs/objects/batch               per object: no actions when the repository has the blob
                                                        (a resumed upload skips it), else an upload href on the
                                                        storage port
  PUT  /lfs-upload/{repo}/{sha256}                      the blob (storage port); refused 400 unless its bytes hash
                                                        to the name: a cut-off body is never stored
  POST /api/models/{repo}/commit/{rev}[?create_pr=1]   ndjson header / file / lfsFile / deletedFile: the files
                                                        land in the revision's folder, a new commit sha; with
                                                        create_pr, on a new pull request's ref refs/pr/N started
                                                        from {rev}, its URL as pullRequestUrl (.../discussions/N)
  POST /api/models/{repo}/branch/{branch}               {startingPoint}: a branch with its own files, started from
                                                        that revision (main when absent); 409 if it exists
A branch or pull request (`Repo.refs`) is a tree of its own: model info, tree, resolve, preupload and commit at
its name (or its current commit) answer from it; the revisions `add_repo` names are aliases of main.
Writes need a token (401), one of the repository's `writers` when it names some (403). `hold_puts_after(n)` lets n
more LFS uploads through and holds the next ones (a push to kill mid-way) until `release_puts()`; `refuse_puts()`
answers them 403; `refuse_commits_adding(path)` answers 500 to a commit adding `path` (a push cut off between its
commits).

Errors carry the Hub's X-Error-Code: RepoNotFound (401 without a token, 404 with one: the Hub does not tell a
private repository from a missing one), RevisionNotFound (404), EntryNotFound (404, with X-Repo-Commit),
GatedRepo (401 without a token, 403 with a token that has no access). Requests and response body bytes are
counted (`stats`, `reset`; `stats.auth_to_storage` counts blob requests that carried a token off the Hub);
`fail_after(n)` drops every connection after n more blob reads (a network failure mid-way), `expire_after(n)`
expires every storage URL handed out so far after n more."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt")
GITATTRIBUTES = "".join(f"*{s} filter=lfs diff=lfs merge=lfs -text\n" for s in LFS_SUFFIXES)  # a new repo's
RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


@dataclass
class Repo:
    repo_id: str
    folder: Path
    files: dict[str, Path]
    sha: str
    revisions: set[str]
    gated: bool = False
    private: bool = False
    tokens: set[str] = field(default_factory=set)  # tokens with access (gated or private)
    content_sha: bool = False  # LFS oids are the files' real sha256 (what a streamed download is checked against)
    shas: dict = field(default_factory=dict)
    writers: set[str] = field(default_factory=set)  # tokens that may push (empty: any token)
    commits: list = field(default_factory=list)  # (sha, summary, added, deleted paths) of each commit pushed
    ref: str = "main"  # the branch (or refs/pr/N) this tree is
    refs: dict = field(default_factory=dict)  # on main's record: the other branches and pull requests, by name

    def is_lfs(self, name: str) -> bool:
        return name.endswith(LFS_SUFFIXES)

    def oid(self, name: str) -> str:
        """A stable content id: the sha256 of an LFS file (of its name and size for sparse test files, which the
        client never checks on range reads), the git blob id of a regular file."""
        path = self.files[name]
        if self.is_lfs(name) and self.content_sha:
            if name not in self.shas:
                self.shas[name] = hashlib.sha256(path.read_bytes()).hexdigest()
            return self.shas[name]
        if self.is_lfs(name):
            return hashlib.sha256(f"{self.repo_id}/{name}:{path.stat().st_size}".encode()).hexdigest()
        data = path.read_bytes()
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Stats:
    requests: int = 0
    bytes: int = 0  # response bodies
    auth_to_storage: int = 0  # blob requests with an Authorization header (a token sent off the Hub)
    log: list = field(default_factory=list)  # (method, path, range, status, body bytes)


class HubServer:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.blobs: dict[str, tuple[Repo, str]] = {}  # sha256 -> (repo, file)
        self.stats = Stats()
        self.lock = threading.Lock()
        self._fail_after: int | None = None
        self._expire_after: int | None = None
        self.generation = 0  # storage URLs carry it; older ones have expired
        self.rate: float | None = None  # bytes per second of all blob bodies together (a slow link), None: unlimited
        self.link_free_at = 0.0  # when the capped link has sent everything queued on it
        self.faults: list[tuple] = []  # one-shot faults for the next blob GETs: ("drop", after_bytes) or
        #                                ("status", code, retry_after)
        self.corrupt: set[str] = set()  # oids whose bytes are served with one byte changed (the sha256 stays)
        self.httpd: ThreadingHTTPServer | None = None
        self.storage: ThreadingHTTPServer | None = None
        self.upload_root = Path(tempfile.mkdtemp(prefix="hub-server-"))  # pushed repositories and LFS blobs
        self.uploaded: dict[tuple[str, str], Path] = {}  # (repo, sha256) -> blob an LFS upload to it received
        self._puts_left: int | None = None  # LFS uploads let through before the next ones are held
        self.puts_released = threading.Event()
        self.puts_refused = False
        self.commits_refused: str | None = None  # a commit adding this path is answered 500

    # ---- setup -------------------------------------------------------------------------------------------------
    def add_repo(self, repo_id: str, folder: Path, revisions=("main",), gated=False, private=False,
                 tokens=(), content_sha=False) -> Repo:
        folder = Path(folder)
        files = {str(p.relative_to(folder)): p for p in sorted(folder.rglob("*"))
                 if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)}
        sha = hashlib.sha1(repo_id.encode() + b"".join(f"{n}:{p.stat().st_size}".encode()
                                                          for n, p in files.items())).hexdigest()
        repo = Repo(repo_id, folder, files, sha, set(revisions) | {sha}, gated, private, set(tokens), content_sha)
        self.repos[repo_id] = repo
        for name in files:
            if repo.is_lfs(name):
                self.blobs[repo.oid(name)] = (repo, name)
        return repo

    def start(self) -> "HubServer":
        server = self

        class Handler(_Handler):
            hub = server

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.storage = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        for httpd in (self.httpd, self.storage):
            httpd.daemon_threads = True
            threading.Thread(target=httpd.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.puts_released.set()
        for httpd in (self.httpd, self.storage):
            if httpd is not None:
                httpd.shutdown()
                httpd.server_close()
        shutil.rmtree(self.upload_root, ignore_errors=True)

    # ---- uploads -----------------------------------------------------------------------------------------------
    def create_repo(self, repo_id: str, private: bool = False, writers=(), gitattributes: bool = False) -> Repo:
        """An empty repository pushes land in (what POST /api/repos/create makes: with the Hub's `.gitattributes`
        when `gitattributes`)."""
        folder = self.upload_root / "repos" / repo_id
        folder.mkdir(parents=True, exist_ok=True)
        repo = self.add_repo(repo_id, folder, private=private, content_sha=True)
        repo.writers = set(writers)
        if gitattributes:
            (folder / ".gitattributes").write_text(GITATTRIBUTES)
            repo.files = {".gitattributes": folder / ".gitattributes", **repo.files}
        return repo

    def hold_puts_after(self, n: int) -> None:
        """Let `n` more LFS uploads through, then hold every later one until `release_puts()`."""
        with self.lock:
            self._puts_left = n
            self.puts_released.clear()

    def release_puts(self) -> None:
        with self.lock:
            self._puts_left = None
        self.puts_released.set()

    def refuse_puts(self, refused: bool = True) -> None:
        """Answer every LFS upload 403 (the storage refusing the signed URL)."""
        self.puts_refused = refused

    def refuse_commits_adding(self, path: str | None) -> None:
        """Answer 500 to every commit that adds `path` (None: none), as a push cut off between its commits."""
        self.commits_refused = path

    def _put_gate(self) -> None:
        with self.lock:
            if self._puts_left is None:
                return
            self._puts_left -= 1
            hold = self._puts_left < 0
        if hold:
            self.puts_released.wait(timeout=120)

    def store_blob(self, repo_id: str, oid: str, data: bytes) -> None:
        path = self.upload_root / "lfs" / oid
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
        with self.lock:
            self.uploaded[(repo_id, oid)] = path

    def blob_of(self, repo: Repo, oid: str) -> Path | None:
        """The repository's LFS object `oid` (uploaded to it, or a file one of its branches holds), as the Hub's
        LFS storage is per repository."""
        if (repo.repo_id, oid) in self.uploaded:
            return self.uploaded[(repo.repo_id, oid)]
        main = self.repos[repo.repo_id]
        return next((p for tree in (repo, main, *main.refs.values()) for n, p in tree.files.items()
                     if tree.is_lfs(n) and tree.oid(n) == oid), None)

    def tree_at(self, repo: Repo, revision: str | None) -> Repo | None:
        """The tree of `repo` (main's record) at `revision`: main (or an alias, or one of its commits), a branch or
        pull request by name or by its current commit; None when there is no such revision."""
        if not revision or revision in repo.revisions:
            return repo
        return next((tree for tree in repo.refs.values() if revision in tree.revisions), None)

    def create_ref(self, repo: Repo, name: str, start: Repo) -> Repo:
        """A branch (or a pull request's refs/pr/N) of `repo` holding `start`'s files at its commit."""
        folder = self.upload_root / "refs" / repo.repo_id / name.replace("/", "%2F")
        shutil.copytree(start.folder, folder, dirs_exist_ok=True)
        tree = Repo(repo.repo_id, folder, {n: folder / n for n in start.files}, start.sha, {name, start.sha},
                    repo.gated, repo.private, repo.tokens, True, writers=repo.writers, ref=name)
        repo.refs[name] = tree
        return tree

    def apply_commit(self, repo: Repo, summary: str, ops: list[dict]) -> str:
        """Write a commit's files into the repository's folder; returns the new commit sha."""
        with self.lock:
            for key, value in ops:
                target = repo.folder / value["path"]
                if key == "deletedFile":
                    target.unlink(missing_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                if key == "file":
                    target.write_bytes(base64.b64decode(value["content"]))
                else:
                    source = self.blob_of(repo, value["oid"])
                    if source != target:
                        shutil.copyfile(source, target)
            repo.files = {str(p.relative_to(repo.folder)): p for p in sorted(repo.folder.rglob("*")) if p.is_file()}
            repo.shas = {}
            on = "" if repo.ref == "main" else repo.ref  # the same change on two branches: two commits
            repo.sha = hashlib.sha1((repo.sha + on + summary + json.dumps(ops, sort_keys=True)).encode()).hexdigest()
            repo.revisions.add(repo.sha)
            repo.commits.append((repo.sha, summary, [v["path"] for k, v in ops if k != "deletedFile"],
                                 [v["path"] for k, v in ops if k == "deletedFile"]))
        for name in repo.files:
            if repo.is_lfs(name):
                self.blobs[repo.oid(name)] = (repo, name)
        return repo.sha

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    @property
    def storage_url(self) -> str:
        return f"http://127.0.0.1:{self.storage.server_address[1]}"

    def reset(self) -> None:
        with self.lock:
            self.stats = Stats()
            self._fail_after = self._expire_after = None
            self.faults, self.corrupt, self.rate = [], set(), None

    def expire_after(self, n: int) -> None:
        """Serve `n` more blob requests, then expire every storage URL handed out so far."""
        with self.lock:
            self._expire_after = n

    def fail_after(self, n: int) -> None:
        """Serve `n` more blob (LFS) requests, then drop every connection without an answer."""
        with self.lock:
            self._fail_after = n

    def limit_rate(self, bytes_per_s: float | None) -> None:
        """Serve blob bodies at `bytes_per_s` in all (one link's bandwidth, shared by every connection), or
        unthrottled (None)."""
        self.rate = bytes_per_s

    def _send_slot(self, nbytes: int) -> float:
        """Queue `nbytes` on the capped link: the time by which they have gone out."""
        with self.lock:
            start = max(time.perf_counter(), self.link_free_at)
            self.link_free_at = start + nbytes / self.rate
            return self.link_free_at

    def drop_mid_blob(self, after_bytes: int, times: int = 1) -> None:
        """The next `times` blob GETs send `after_bytes` bytes of their body, then drop the connection."""
        with self.lock:
            self.faults += [("drop", after_bytes)] * times

    def answer_status(self, status: int, retry_after: int | None = None, times: int = 1) -> None:
        """The next `times` blob GETs are answered `status` (429, 503...) with `Retry-After` when given."""
        with self.lock:
            self.faults += [("status", status, retry_after)] * times

    def corrupt_file(self, repo_id: str, name: str) -> None:
        """Serve `name` of `repo_id` with one byte changed, under its real sha256 (a corrupted download)."""
        repo = self.repos[repo_id]
        self.corrupt.add(repo.oid(name))

    def _next_fault(self) -> tuple | None:
        with self.lock:
            return self.faults.pop(0) if self.faults else None

    def _count(self, method, path, rng, status, nbytes) -> None:
        with self.lock:
            self.stats.requests += 1
            self.stats.bytes += nbytes
            self.stats.log.append((method, path, rng, status, nbytes))

    def _blob_allowed(self) -> bool:
        with self.lock:
            if self._expire_after is not None:
                self._expire_after -= 1
                if self._expire_after < 0:
                    self.generation += 1
                    self._expire_after = None
            if self._fail_after is None:
                return True
            self._fail_after -= 1
            return self._fail_after >= 0


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"  # keep-alive, as the Hub's front ends
    drop_after: int | None = None  # this response: drop the connection after so many body bytes
    rate: float | None = None  # this response: body bytes per second

    def log_message(self, *args) -> None:  # quiet
        pass

    # ---- plumbing ----------------------------------------------------------------------------------------------
    def _send(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        head = self.command == "HEAD"
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        if "Content-Length" not in (headers or {}):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self._write_body(body)
        self.hub._count(self.command, self.path, self.headers.get("Range"), status, 0 if head else len(body))

    def _write_body(self, body: bytes) -> None:
        """The body, in 64 kB pieces at the link's `rate` (shared with every other body under way), cut after `drop_after` bytes (the connection
        then dropped) when this response carries a fault."""
        if self.rate is None and self.drop_after is None:
            self.wfile.write(body)
            return
        step, sent = 1 << 16, 0
        while sent < len(body):
            piece = body[sent:sent + step]
            if self.drop_after is not None and sent + len(piece) > self.drop_after:
                self.wfile.write(piece[:max(0, self.drop_after - sent)])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                raise ConnectionResetError("fault: connection dropped mid-body")
            if self.rate:
                ahead = self.hub._send_slot(len(piece)) - time.perf_counter()
                if ahead > 0:
                    time.sleep(ahead)
            self.wfile.write(piece)
            sent += len(piece)

    def _json(self, status: int, obj, headers: dict | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _error(self, status: int, code: str, message: str, headers: dict | None = None) -> None:
        self._json(status, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message, **(headers or {})})

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization") or ""
        return auth[7:] if auth.startswith("Bearer ") else None

    def _repo_at(self, repo_id: str, revision: str, files: bool = True) -> Repo | None:
        """The repository's tree at `revision`, or None after answering as the Hub does."""
        repo = self._repo(repo_id, files=files)
        if repo is None:
            return None
        tree = self.hub.tree_at(repo, revision)
        if tree is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return tree

    def _repo(self, repo_id: str, files: bool) -> Repo | None:
        """The repository, or None after answering as the Hub does (missing, private, gated)."""
        repo = self.hub.repos.get(repo_id)
        token = self._token()
        if repo is None or (repo.private and token not in repo.tokens):
            self._error(401 if token is None else 404, "RepoNotFound", "Repository not found")
            return None
        if files and repo.gated and token not in repo.tokens:
            if token is None:
                self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access "
                                              f"to it and be authenticated to access it. Please log in.")
            else:
                self._error(403, "GatedRepo", f"Access to model {repo_id} is restricted and you are not in the "
                                              f"authorized list. Visit https://huggingface.co/{repo_id} to ask "
                                              f"for access.")
            return None
        return repo

    def _ranged(self, data_len: int, read, headers: dict) -> None:
        """Answer a GET or HEAD of `data_len` bytes (read(begin, end) -> bytes), honouring one `Range`."""
        rng = self.headers.get("Range")
        headers = {**headers, "Accept-Ranges": "bytes"}
        if rng:
            m = RANGE.match(rng.strip())
            if m and (m.group(1) or m.group(2)):
                if m.group(1):
                    begin = int(m.group(1))
                    end = min(int(m.group(2)) if m.group(2) else data_len - 1, data_len - 1)
                else:  # suffix range: the last n bytes
                    begin, end = max(0, data_len - int(m.group(2))), data_len - 1
                if begin >= data_len:
                    self._send(416, b"", {**headers, "Content-Range": f"bytes */{data_len}"})
                    return
                body = read(begin, end + 1) if self.command == "GET" else b""
                self._send(206, body, {**headers, "Content-Range": f"bytes {begin}-{end}/{data_len}",
                                       "Content-Length": end + 1 - begin})
                return
        body = read(0, data_len) if self.command == "GET" else b""
        self._send(200, body, {**headers, "Content-Length": data_len})

    # ---- endpoints ---------------------------------------------------------------------------------------------
    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        try:
            if path == "/api/agent-harnesses":  # huggingface_hub's user-agent telemetry: an empty registry
                self._json(200, {"standardEnvVars": [], "harnesses": {}})
            elif path.startswith("/api/models/") and "/tree/" in path:
                repo_id, rest = path[len("/api/models/"):].split("/tree/", 1)
                self._tree(repo_id, *split_revision(rest))
            elif path.startswith("/api/models/"):
                self._model_info(path[len("/api/models/"):], "blobs=true" in url.query)
            elif path.startswith("/cdn/"):
                self._blob(path[len("/cdn/"):], url.query)
            elif "/resolve/" in path:
                repo_id, rest = path[1:].split("/resolve/", 1)
                self._resolve(repo_id, *split_revision(rest))
            else:
                self._error(404, "NotFound", "Not found")
        except (BrokenPipeError, ConnectionResetError):
            pass

    # ---- uploads -----------------------------------------------------------------------------------------------
    def _body(self) -> bytes:
        """The request body, by Content-Length or chunked (whatever arrived when the client went away)."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                line = self.rfile.readline()
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def do_POST(self) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        create_pr = "create_pr=1" in url.query.split("&")
        try:
            body = self._body()
            if path == "/api/repos/create":
                self._create_repo(json.loads(body))
            elif path == "/api/validate-yaml":
                self._validate_yaml(json.loads(body))
            elif path.endswith(".git/info/lfs/objects/batch"):
                self._lfs_batch(path[1:-len(".git/info/lfs/objects/batch")], json.loads(body))
            elif path.startswith("/api/models/") and "/preupload/" in path:
                self._preupload(*path[len("/api/models/"):].split("/preupload/", 1), json.loads(body))
            elif path.startswith("/api/models/") and "/commit/" in path:
                self._commit(*path[len("/api/models/"):].split("/commit/", 1), body, create_pr)
            elif path.startswith("/api/models/") and "/branch/" in path:
                self._create_branch(*path[len("/api/models/"):].split("/branch/", 1), json.loads(body or b"{}"))
            else:
                self._error(404, "NotFound", "Not found")
        except (BrokenPipeError, ConnectionResetError):
            pass

    def do_PUT(self) -> None:
        path = unquote(urlsplit(self.path).path)
        try:
            if not path.startswith("/lfs-upload/"):
                self._error(404, "NotFound", "Not found")
                return
            self.hub._put_gate()
            body = self._body()
            repo_id, _, oid = path[len("/lfs-upload/"):].rpartition("/")
            if self.hub.puts_refused:
                self._send(403, b"<Error><Code>AccessDenied</Code></Error>", {"Content-Type": "application/xml"})
            elif hashlib.sha256(body).hexdigest() != oid:
                self._send(400, b"<Error><Code>BadDigest</Code></Error>", {"Content-Type": "application/xml"})
            else:
                self.hub.store_blob(repo_id, oid, body)
                self._send(200, b"", {"ETag": f'"{oid}"'})
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass

    def _writable(self, repo_id: str) -> Repo | None:
        """The repository a push writes to, or None after answering as the Hub does (no token, no rights)."""
        token = self._token()
        if token is None:
            self._error(401, "Unauthorized", "You must be authenticated to push")
            return None
        repo = self._repo(repo_id, files=True)
        if repo is not None and repo.writers and token not in repo.writers:
            self._error(403, "Forbidden", f"You don't have the rights to create a commit in {repo_id}")
            return None
        return repo

    def _create_repo(self, payload: dict) -> None:
        if self._token() is None:
            self._error(401, "Unauthorized", "You must be authenticated to create a repository")
            return
        repo_id = f"{payload.get('organization') or 'user'}/{payload['name']}"
        url = f"{self.hub.url}/{repo_id}"
        if repo_id in self.hub.repos:
            self._json(409, {"error": "You already created this model repo", "url": url})
            return
        self.hub.create_repo(repo_id, private=payload.get("visibility") == "private",
                             gitattributes=True).tokens.add(self._token())
        self._json(200, {"url": url, "name": repo_id})

    def _validate_yaml(self, payload: dict) -> None:
        import yaml

        m = re.match(r"^---\n(.*?)\n---\n", payload.get("content", ""), re.S)
        try:
            meta = yaml.safe_load(m.group(1)) if m else {}
        except yaml.YAMLError as e:
            self._json(400, {"errors": [{"message": f"invalid YAML: {e}"}]})
            return
        base = (meta or {}).get("base_model") if isinstance(meta, (dict, type(None))) else "?"
        if base is not None and not (isinstance(base, str) and re.fullmatch(r"[\w.-]+/[\w.-]+", base)):
            self._json(400, {"errors": [{"message": f"\"base_model\" must be a model id, not {base!r}"}]})
            return
        self._json(200, {"errors": [], "warnings": []})

    def _preupload(self, repo_id: str, revision: str, payload: dict) -> None:
        repo = self._writable(repo_id)
        repo = repo and self._tree_or_404(repo, revision)
        if repo is None:
            return
        files = []
        for f in payload["files"]:
            name = f["path"]
            files.append({"path": name, "uploadMode": "lfs" if repo.is_lfs(name) else "regular",
                          "shouldIgnore": False, "oid": repo.oid(name) if name in repo.files else None})
        self._json(200, {"files": files, "commitOid": repo.sha})

    def _lfs_batch(self, repo_id: str, payload: dict) -> None:
        repo = self._writable(repo_id)
        if repo is None:
            return
        objects = []
        for obj in payload["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"]}
            if self.hub.blob_of(repo, obj["oid"]) is None:
                entry["actions"] = {"upload": {"href": f"{self.hub.storage_url}/lfs-upload/{repo_id}/{obj['oid']}"}}
            objects.append(entry)
        self._json(200, {"transfer": "basic", "objects": objects})

    def _tree_or_404(self, repo: Repo, revision: str) -> Repo | None:
        tree = self.hub.tree_at(repo, revision)
        if tree is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return tree

    def _create_branch(self, repo_id: str, branch: str, payload: dict) -> None:
        repo = self._writable(repo_id)
        start = repo and self._tree_or_404(repo, payload.get("startingPoint") or "main")
        if start is None:
            return
        if branch == "main" or branch in repo.refs or branch in repo.revisions:
            self._error(409, "Conflict", f"Reference already exists: refs/heads/{branch}")
            return
        self.hub.create_ref(repo, branch, start)
        self._json(200, {})

    def _commit(self, repo_id: str, revision: str, body: bytes, create_pr: bool = False) -> None:
        main = self._writable(repo_id)
        repo = main and self._tree_or_404(main, revision)
        if repo is None:
            return
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        header = next(item["value"] for item in lines if item["key"] == "header")
        ops = [(item["key"], item["value"]) for item in lines if item["key"] != "header"]
        missing = [v["path"] for k, v in ops if k == "lfsFile" and self.hub.blob_of(repo, v["oid"]) is None]
        if missing:
            self._error(422, "BadRequest", f"LFS pointer for {missing[0]} has no uploaded object")
            return
        if self.hub.commits_refused in [v["path"] for k, v in ops if k != "deletedFile"]:
            self._error(500, "InternalError", "Internal Error - We're working hard to fix this as soon as possible!")
            return
        pr_url = None
        if create_pr:
            number = 1 + sum(name.startswith("refs/pr/") for name in main.refs)
            repo = self.hub.create_ref(main, f"refs/pr/{number}", repo)
            pr_url = f"{self.hub.url}/{repo_id}/discussions/{number}"
        sha = self.hub.apply_commit(repo, header["summary"], ops)
        self._json(200, {"commitUrl": f"{self.hub.url}/{repo_id}/commit/{sha}", "commitOid": sha,
                         "pullRequestUrl": pr_url})

    def _model_info(self, rest: str, blobs: bool) -> None:
        repo_id, _, revision = rest.partition("/revision/")
        repo = self._repo_at(repo_id, revision, files=False)
        if repo is None:
            return
        siblings = []
        for name, p in repo.files.items():
            sib = {"rfilename": name}
            if blobs:
                size = p.stat().st_size
                sib.update(size=size, blobId=repo.oid(name) if not repo.is_lfs(name) else hashlib.sha1(
                    repo.oid(name).encode()).hexdigest())
                if repo.is_lfs(name):
                    sib["lfs"] = {"sha256": repo.oid(name), "size": size, "pointerSize": 134}
            siblings.append(sib)
        self._json(200, {"_id": repo.sha[:24], "id": repo_id, "modelId": repo_id, "sha": repo.sha,
                         "private": repo.private, "gated": "manual" if repo.gated else False, "disabled": False,
                         "tags": [], "siblings": siblings})

    def _tree(self, repo_id: str, revision: str, folder: str) -> None:
        """The file list snapshot_download asks for (`list_repo_tree`, recursive; one page)."""
        repo = self._repo_at(repo_id, revision)
        if repo is None:
            return
        entries = []
        for name, p in repo.files.items():
            if folder and not name.startswith(folder.rstrip("/") + "/"):
                continue
            size = p.stat().st_size
            blob = hashlib.sha1(repo.oid(name).encode()).hexdigest() if repo.is_lfs(name) else repo.oid(name)
            entry = {"type": "file", "path": name, "size": size, "oid": blob}  # a regular file's git blob id
            if repo.is_lfs(name):
                entry["lfs"] = {"oid": repo.oid(name), "size": size, "pointerSize": 134}
            entries.append(entry)
        self._json(200, entries)

    def _resolve(self, repo_id: str, revision: str, name: str) -> None:
        repo = self._repo_at(repo_id, revision)
        if repo is None:
            return
        commit = {"X-Repo-Commit": repo.sha}
        if name not in repo.files:
            self._error(404, "EntryNotFound", "Entry not found", commit)
            return
        path = repo.files[name]
        if repo.is_lfs(name):
            oid = repo.oid(name)
            location = f"{self.hub.storage_url}/cdn/{oid}?expires={self.hub.generation}"
            self._send(302, b"", {**commit, "Location": location, "ETag": f'"{oid}"',
                                  "X-Linked-Etag": f'"{oid}"', "X-Linked-Size": path.stat().st_size})
            return
        data = path.read_bytes()
        self._ranged(len(data), lambda b, e: data[b:e], {**commit, "ETag": f'"{repo.oid(name)}"',
                                                         "Content-Type": "application/octet-stream"})

    def _blob(self, oid: str, query: str) -> None:
        if oid not in self.hub.blobs:
            self._send(404, b"not found")
            return
        if self.headers.get("Authorization"):
            with self.hub.lock:
                self.hub.stats.auth_to_storage += 1
        allowed = self.hub._blob_allowed()
        if query != f"expires={self.hub.generation}":
            self._send(403, b"<Error><Code>AccessDenied</Code><Message>Request has expired</Message></Error>",
                       {"Content-Type": "application/xml"})
            return
        if not allowed:
            self.hub._count(self.command, self.path, self.headers.get("Range"), 0, 0)
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)  # no answer at all: the client sees the connection drop
            return
        fault = self.hub._next_fault() if self.command == "GET" else None
        if fault is not None and fault[0] == "status":
            _, code, retry_after = fault
            self._send(code, b"slow down", {"Retry-After": retry_after} if retry_after is not None else {})
            return
        self.drop_after = fault[1] if fault is not None else None
        self.rate = self.hub.rate
        repo, name = self.hub.blobs[oid]
        path = repo.files[name]
        corrupt = oid in self.hub.corrupt

        def read(begin: int, end: int) -> bytes:
            with open(path, "rb") as f:
                f.seek(begin)
                data = f.read(end - begin)
            last = path.stat().st_size - 1
            if corrupt and begin <= last < end:  # the last byte of the tensor data changed
                data = data[:last - begin] + bytes([data[last - begin] ^ 0xFF])
            return data

        self._ranged(path.stat().st_size, read, {"ETag": f'"{oid}"', "Content-Type": "binary/octet-stream"})


PR_REVISION = re.compile(r"^(refs/pr/\d+|refs/convert/[^/]+|[^/]+)(?:/(.*))?$")


def split_revision(rest: str) -> tuple[str, str]:
    """(revision, path) of `REV/PATH` in a URL already unquoted: a pull request's refs/pr/N keeps its slashes."""
    m = PR_REVISION.match(rest)
    return m.group(1), m.group(2) or ""


def one_line(code: int, out: str, err: str, expect: int) -> str:
    """The run's single `error:` line, after checking it exited `expect` with nothing on stdout."""
    lines = err.strip().splitlines()
    assert code == expect and out == "" and len(lines) == 1 and lines[0].startswith("error: "), (code, out, err)
    return lines[0]


class DiskWatch:
    """Samples `measure()` (bytes on disk) every few milliseconds while in use; `peak` is the most seen."""

    def __init__(self, measure):
        self.measure, self.peak, self.stop = measure, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.measure())
            time.sleep(0.002)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def main(argv: list[str] | None = None) -> int:
    """`python tests/hub_server.py ORG/NAME=DIR ...`: serve local checkpoints as Hub repositories until
    Ctrl-C (the README's offline Hub workflow). Prints one line, the variables huggingface_hub needs to talk to it;
    pushes land in a temporary folder, which goes when the server stops."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(description="A local Hub for trying the Hub workflow offline.")
    parser.add_argument("repos", nargs="+", metavar="ORG/NAME=DIR", help="a directory served as a model repository")
    args = parser.parse_args(argv)
    server = HubServer().start()
    for spec in args.repos:
        repo_id, _, folder = spec.partition("=")
        if repo_id.count("/") != 1 or not Path(folder).is_dir():
            parser.error(f"{spec}: expected ORG/NAME=DIR with DIR a directory")
        server.add_repo(repo_id, Path(folder), content_sha=True)  # the Hub's sha256 of every LFS file
    # HF_HUB_DISABLE_XET: this server speaks the LFS protocol, not Xet storage
    # HF_HUB_OFFLINE=0: this Hub is on the machine, so an offline one (TRANSFORMERS_OFFLINE=1 included) reaches it
    print(f"export HF_ENDPOINT={server.url} HF_HUB_DISABLE_XET=1 HF_HUB_OFFLINE=0", flush=True)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))  # `kill`: stop as Ctrl-C does
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
