"""`quant push EXPORT ORG/NAME`: a finished, verified export uploaded to the Hub with its model card.

What is published is what the export's owner record (`.quant-owner.json`, quant.ownership) says `quant quantize`
wrote, less the tool's bookkeeping: the shards, the index, config.json, quant_manifest.json, the model card
(README.md, with `eval_report.png` once `quant eval --card` filled it), a user's recipe file and the side files
copied from the source (tokenizer, generation config, chat template...). Never a name starting with `.` (the
owner record, the lock, `.quant-complete`, the scratch directories `.quant-progress/`, `.quant-source/`, ...),
never a file the record does not name (a user's notes beside the export). Each is checked against the size and
sha256 the record holds, so what is uploaded is the export the self-check passed; only the model card may have
been edited since (it is uploaded as it stands).

Before anything is sent the export is checked as `quant verify-manifest EXPORT --scales` checks it, for the engines
its scheme loads in (the manifest's `engines.scheme_loads_in`, or `--engine`): an error refuses the push (exit 1,
nothing uploaded) unless `force`.

Where it goes: a push never deletes or replaces a file it did not write. Before any request that writes, the
repository is listed (at its main branch's commit, which the first commit then names as its parent): it must not
exist yet, be empty (only the `.gitattributes` the Hub creates), or hold only files of this export with the same
content (the sha256 of an LFS file, the git blob id of another) and files an earlier push of this same export
wrote. What a push writes is recorded in `.quant-push.json`, uploaded with its first commit: the export's identity
(its shards' sha256, as its manifest records them) and each file sent with its sha256 and git blob id (and the
earlier push's versions of files still to be replaced, should the record land before them), so an interrupted or
repeated push of the same export (a model card edited since, say) finds its own files and goes on.
A repository holding anything else (a user's README.md, config.json or weights, a file edited on the Hub since the
push, another export's push) is refused in one line naming the repository and the first such file (exit 2),
nothing sent; so is the export's own source repository (its manifest's `hf://ORG/NAME[@REV]`, or a source
directory in huggingface_hub's cache, `models--ORG--NAME/snapshots/`; any case), before the preflight.

The upload is huggingface_hub's `upload_folder` (of a scratch folder of links to the published files and the
record): from huggingface_hub 2.x on, its resumable large-folder upload (`upload_large_folder` before; over the
Hub's Xet storage when hf_xet is installed: a re-run skips committed files and sends no chunk the Hub already
holds; without hf_xet, LFS: a re-run skips every blob the Hub already holds). A repository that already holds
every file of the export, and nothing else of an earlier push, gets nothing. Otherwise everything but config.json
goes first, with the record and the deletion of the repository's earlier config.json (and of what an earlier push
of the export wrote that it no longer has), and config.json in a commit of its own after it: the repository never
holds a config.json whose shards are not all there (as OUT never does locally). An earlier export's shards of
other names are never deleted: their repository is refused.
"""

from __future__ import annotations

import glob
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from quant.errors import EngineFailure, QuantError, machine_failure
from quant.files import git_blob_id, sha256_file
from quant.hub import REPO_REF, HubRef
from quant.ownership import read_record, real_path, regular_file, unchanged
from quant.pipeline.model_card import CARD_FILE
from quant.pipeline.output import COMPLETE_MARKER, MANIFEST_FILE
from quant.verify import verify_checkpoint
from quant.verify.scales import scan_scales

LAST = "config.json"  # uploaded after everything else
PUSH_RECORD = ".quant-push.json"  # what a push wrote, in its first commit: the export's shards and the files sent
HUB_FILES = {".gitattributes"}  # what the Hub writes into a repository it creates
REGULAR_MAX = 64 << 20  # the largest file the Hub may keep as a regular (non-LFS) file, with room
BRANCH = re.compile(r"refs/pr/[1-9]\d*|(?!refs/)(?!.*\.\.)[\w.-]+(?:/[\w.-]+)*")  # what --revision may name
CACHED_SOURCE = re.compile(r"(?:^|/)models--([^/]+?)--([^/]+)/snapshots/")  # huggingface_hub's cache layout


@dataclass
class Export:
    """A finished export and the files of it that are published, with their size and sha256."""

    root: Path
    files: dict[str, tuple[int, str]]
    card_edited: bool = False

    @property
    def bytes(self) -> int:
        return sum(size for size, _ in self.files.values())

    def identity(self) -> dict[str, str]:
        """What tells this export from another: its shards and their sha256 (its manifest's output shards)."""
        return {name: sha256 for name, (_, sha256) in sorted(self.files.items()) if name.endswith(".safetensors")}

    def engines(self) -> list[str] | None:
        """The engines the export's scheme loads in (its manifest), for the preflight."""
        try:
            manifest = json.loads((self.root / MANIFEST_FILE).read_text())
            engines = manifest["engines"]["scheme_loads_in"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return list(engines) if isinstance(engines, list) and engines else None


def push_target(text: str, revision: str | None = None, create_pr: bool = False) -> HubRef:
    """ORG/NAME of the repository to push to, with the branch (or refs/pr/N) `--revision` names."""
    m = REPO_REF.match(text)
    if m is None or m.group("rev") or ".." in m.group("repo") or "--" in m.group("repo"):
        raise QuantError(f"{text}: not a Hub repository id to push to (ORG/NAME, no @REVISION: --revision names "
                         f"the branch to push to)")
    if revision is not None and create_pr:
        raise QuantError(f"--revision {revision} --create-pr: a pull request is opened against main (as "
                         f"`hf upload --create-pr`); to finish one a push opened, pass only --revision refs/pr/N")
    if revision is not None and not BRANCH.fullmatch(revision):
        raise QuantError(f"--revision {revision}: not a branch name or a pull request's refs/pr/N to push to")
    return HubRef(m.group("repo"), revision)


def finished_export(path: Path) -> Export:
    """The published files of the export at `path`; refused (one line, exit 2) when it is not a finished export
    of `quant quantize` or a file of it changed since it was written."""
    if not path.is_dir():
        raise QuantError(f"{path}: not a directory (the export to push)")
    record = read_record(path)  # NotOurs (exit 2) for a record that fails its check
    if record is None or record.kind != "quantize":
        raise QuantError(f"{path}: not an export of `quant quantize` (no owner record of one): only a finished, "
                         f"verified export is pushed")
    root = real_path(path)
    if regular_file(root, COMPLETE_MARKER) is None or regular_file(root, LAST) is None:
        raise QuantError(f"{path}: an unfinished export (no config.json): run the same `quant quantize` to finish "
                         f"it, then push")
    files, card_edited = {}, False
    for name, entry in sorted(record.files.items()):
        if any(part.startswith(".") for part in name.split("/")):
            continue  # the tool's bookkeeping and scratch
        if name == CARD_FILE and regular_file(root, name) is not None and not unchanged(root, name, entry):
            card_edited = True  # the user's edits to the card are theirs to publish
            st = regular_file(root, name)
            files[name] = (st.st_size, sha256_file(root / name))
            continue
        if not unchanged(root, name, entry):
            raise QuantError(f"{path / name}: changed or missing since `quant quantize` wrote it; nothing was "
                             f"uploaded: run the same quantize again to restore the export, then push")
        files[name] = entry
    return Export(root, files, card_edited)


def preflight(export: Export, engines: list[str] | None, force: bool, log=print) -> int:
    """`quant verify-manifest EXPORT --scales` for `engines` (default: those the export's scheme loads in): an
    error refuses the push (EngineFailure, exit 1) unless `force`. Returns the number of errors found."""

    engines = engines or export.engines()
    report = verify_checkpoint(export.root, engines=engines)
    errors = [f"[{e.engine}] {e.message}" for e in report.errors]
    errors += [f.message for f in scan_scales(export.root) if f.severity == "error"]
    if errors and not force:
        raise EngineFailure(f"{export.root}: not pushed: the preflight finds {len(errors)} error(s) an engine would "
                            f"hit, nothing was uploaded (`quant verify-manifest {export.root} --scales` lists them; "
                            f"--force pushes it anyway); first: {errors[0]}")
    if errors:
        log(f"warning: pushing with {len(errors)} preflight error(s) (--force); first: {errors[0]}")
    return len(errors)


def source_checkpoint(export: Export) -> str | None:
    """The source the export's manifest records (`source.checkpoint`), None when it records none."""
    try:
        ref = json.loads((export.root / MANIFEST_FILE).read_text())["source"]["checkpoint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return ref if isinstance(ref, str) else None


def source_repo(export: Export) -> str | None:
    """The Hub repository the export was quantized from (its manifest's `source.checkpoint`: `hf://ORG/NAME[@REV]`,
    or a local directory in huggingface_hub's cache, `.../models--ORG--NAME/snapshots/REV`), or None."""
    ref = source_checkpoint(export)
    if ref is None:
        return None
    if ref.startswith("hf://"):
        return ref[len("hf://"):].split("@", 1)[0]
    m = CACHED_SOURCE.search(ref.replace("\\", "/"))
    return f"{m.group(1)}/{m.group(2)}" if m else None


def refuse_source(export: Export, target: HubRef) -> None:
    """A push to the export's own source repository is refused (one line, exit 2): it would replace the weights it
    was quantized from."""
    source = source_repo(export)
    if source is not None and source.casefold() == target.repo_id.casefold():
        raise QuantError(f"{target.repo_id}: not pushed, nothing was uploaded: it is the repository {export.root} "
                         f"was quantized from ({MANIFEST_FILE}: source {source_checkpoint(export)}); a push never "
                         f"replaces its source's files: push to another repository")


def push_record(export: Export, carried: dict[str, dict] | None = None) -> dict:
    """What `.quant-push.json` holds: the export's identity (its shards' sha256, as its manifest records them),
    every file this push writes, with its sha256 (an LFS file's id on the Hub) and, for a file the Hub may keep as
    a regular one, its git blob id; and `carried`: the files an earlier push of the export wrote that the
    repository still holds in another version (until this push replaces or deletes them: with hf_xet a large
    upload lands in several commits, the record perhaps before them)."""
    files = {}
    for name, (size, sha256) in sorted(export.files.items()):
        entry = {"size": size, "sha256": sha256}
        if not name.endswith(".safetensors") and size <= REGULAR_MAX:
            entry["git"] = git_blob_id((export.root / name).read_bytes())
        files[name] = entry
    return {"tool": "moe-quant", "record": "quant push", "shards": export.identity(), "files": files,
            "earlier": dict(sorted((carried or {}).items()))}


def written_by(record: dict, name: str, oid: str) -> dict | None:
    """The record's entry for `name` (the file its push wrote, or an earlier version it carried) whose content id
    is `oid`, or None."""
    for part in ("files", "earlier"):
        entries = record.get(part)
        entry = entries.get(name) if isinstance(entries, dict) else None
        if isinstance(entry, dict) and oid in (entry.get("sha256"), entry.get("git")):
            return entry
    return None


def foreign_check(export: Export, target: HubRef, remote: dict[str, str],
                  earlier: dict | None) -> tuple[list[str], dict[str, dict]]:
    """Refuse (QuantError naming the repository and its first foreign file) unless every file the repository holds
    is the Hub's `.gitattributes`, a file of this export with the same content, or a file an earlier push of this
    same export wrote (its `.quant-push.json`, `earlier`, names this export's shards and the file with these
    bytes). Returns those earlier files the export no longer has (the first commit deletes them), and the record
    entries of the earlier files still there in another version than the export's (the new record carries them)."""
    same = isinstance(earlier, dict) and earlier.get("shards") == export.identity()
    stale, carried = [], {}
    for name in sorted(remote):
        oid = remote[name]
        if name in HUB_FILES:
            continue
        if name == PUSH_RECORD:
            if same:
                continue
            what = (f"{PUSH_RECORD} names other shards than {export.root}'s" if earlier is not None else
                    f"{PUSH_RECORD} is not a record of a push this tool can read")
            raise QuantError(f"{target.repo_id}: not pushed, nothing was uploaded: it holds another export's push "
                             f"({what}), and a push never replaces files it did not write for this export: push to "
                             f"another repository (or delete that repository first)")
        if name in export.files and oid == local_oid(export, name, oid):
            continue
        entry = written_by(earlier, name, oid) if same else None
        if entry is not None:
            carried[name] = entry
            if name not in export.files:
                stale.append(name)
            continue
        raise QuantError(f"{target.repo_id}: not pushed, nothing was uploaded: it holds {name}, which is neither a "
                         f"file of {export.root} nor one an earlier push of it wrote; a push goes only to a new or "
                         f"empty repository or one holding this export's earlier push, and never replaces or "
                         f"deletes a file it did not write: push to another repository")
    return stale, carried


@dataclass(frozen=True)
class Pushed:
    """Where a push landed: the URL of its last commit, or of the pull request it opened (`pull_request`)."""

    url: str
    pull_request: str | None = None  # refs/pr/N


def upload(export: Export, target: HubRef, private: bool = False, progress: bool = True, token: str | None = None,
           message: str | None = None, create_pr: bool = False) -> Pushed | None:
    """Upload the export's published files to `target` (created when missing); returns the URL of the last
    commit, None when the repository already holds the export. The repository is listed before anything is
    written: one holding a file that is neither the export's nor an earlier push of it's (`foreign_check`), or the
    export's own source (`refuse_source`), is refused in one line (exit 2) with nothing sent. While anything
    differs, the first commit (every file but config.json, with `.quant-push.json` recording what the push
    writes) deletes the repository's config.json and what an earlier push of the export wrote that it no longer
    has, and the last adds the export's config.json: a config.json on the Hub means the rest is there. Network and
    Hub failures are one line (exit 2): the same command resumes. `token`: instead of HF_TOKEN / `hf auth login`'s
    (as `hf upload --token`); `message`: the commits' summary, each followed by what that commit holds.

    `target.revision` (as `hf upload --revision`): the branch the commits go to, created from main's head once the
    check passes when it does not exist (what the check lists then is main), or a pull request's refs/pr/N.
    `create_pr` (as `hf upload --create-pr`): the first commit opens a pull request against main, the second goes
    to its refs/pr/N; one cut off between them is finished with that revision (the error says which)."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    refuse_source(export, target)
    api = HfApi(endpoint=constants.ENDPOINT, token=token)
    names = sorted(export.files)
    (enable_progress_bars if progress else disable_progress_bars)()
    staging, opened = None, None
    try:
        head, remote, branch_exists = remote_state(api, target)
        if remote is None:  # missing: created, then listed again (someone may have made it meanwhile)
            api.create_repo(target.repo_id, private=private, exist_ok=True)
            head, remote, branch_exists = remote_state(api, target, missing_ok=False)
        earlier = read_push_record(api, target, head) if PUSH_RECORD in remote else None
        stale, carried = foreign_check(export, target, remote, earlier)
        if not stale and all(n in remote and remote[n] == local_oid(export, n, remote[n]) for n in names):
            return None
        if target.revision is not None and not branch_exists:
            api.create_branch(target.repo_id, branch=target.revision, revision=head, exist_ok=True)
        staging = tempfile.TemporaryDirectory(prefix="quant-push-")
        folder = stage(export, Path(staging.name), carried)
        info = None
        summary = message or "moe-quant export"
        for batch, gone, part, parent in (
                ([n for n in names if n != LAST] + [PUSH_RECORD], [LAST] * (LAST in remote) + stale,
                 "weights, index, manifest, model card and side files", head),
                ([LAST], [], "config.json (the export is complete)", None)):
            info = api.upload_folder(repo_id=target.repo_id, folder_path=folder,
                                     allow_patterns=[glob.escape(n) for n in batch],
                                     delete_patterns=[glob.escape(n) for n in gone] if gone else None,
                                     commit_message=f"{summary}: {part}", parent_commit=parent,
                                     revision=opened.pull_request if opened else target.revision,
                                     create_pr=create_pr and opened is None)
            if create_pr and opened is None:
                opened = Pushed(info.pr_url, info.pr_revision)
    except QuantError:
        raise
    except Exception as e:  # noqa: BLE001  (huggingface_hub and httpx raise many types; push_error sorts them)
        machine = machine_failure(e)
        if machine is not None:  # reading the export failed: the machine (exit 74, the export's path named)
            name = os.path.relpath(str(machine.filename), staging.name) if staging and machine.filename else None
            if name in export.files:  # read through the scratch folder's link: the export's file named
                machine = OSError(machine.errno, machine.strerror, str(export.root / name))
            raise machine from None
        raise push_error(e, target, api.endpoint, opened) from None
    finally:
        if staging is not None:
            staging.cleanup()
    return opened or Pushed(info.commit_url)


def stage(export: Export, folder: Path, carried: dict[str, dict]) -> Path:
    """A folder for `upload_folder`: a symbolic link to each published file of the export and this push's
    `.quant-push.json` (huggingface_hub reads the files through the links)."""
    for name in export.files:
        link = folder / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(export.root / name)
    (folder / PUSH_RECORD).write_text(json.dumps(push_record(export, carried), indent=1, sort_keys=True) + "\n")
    return folder


def remote_state(api, target: HubRef, missing_ok: bool = True) -> tuple[str | None, dict[str, str] | None, bool]:
    """(the commit of the branch pushed to, its files there: path -> the sha256 of an LFS file, the git blob id of
    another; whether that branch exists). A branch not there yet is listed as main, which it will start from; a
    pull request's refs/pr/N must exist (QuantError). (None, None, False) when the repository does not exist (or
    the token cannot see it)."""
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError
    from huggingface_hub.hf_api import RepoFile

    exists = True
    try:
        try:
            head = api.repo_info(target.repo_id, revision=target.revision).sha
        except RevisionNotFoundError:
            if target.revision.startswith("refs/pr/"):
                raise QuantError(f"{target.repo_id}: has no pull request {target.revision} to push to (--create-pr "
                                 f"opens one)") from None
            exists, head = False, api.repo_info(target.repo_id).sha
    except RepositoryNotFoundError:
        if not missing_ok:
            raise
        return None, None, False
    return head, {e.path: (e.lfs.sha256 if e.lfs else e.blob_id)
                  for e in api.list_repo_tree(target.repo_id, revision=head, recursive=True)
                  if isinstance(e, RepoFile)}, exists


def read_push_record(api, target: HubRef, revision: str | None) -> dict | None:
    """The repository's `.quant-push.json` (an earlier push's record), None when it is not one."""
    path = api.hf_hub_download(repo_id=target.repo_id, filename=PUSH_RECORD, revision=revision)
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("record") == "quant push" else None


def local_oid(export: Export, name: str, remote: str) -> str | None:
    """The export's file `name` as the repository names its content: its sha256 where the repository holds it as
    an LFS file (`remote` a 64-digit id), else its git blob id (regular files are small: None for a larger one)."""
    if len(remote) == 64:
        return export.files[name][1]
    if export.files[name][0] > REGULAR_MAX:
        return None
    return git_blob_id((export.root / name).read_bytes())


def push_error(e: BaseException, target: HubRef, endpoint: str, opened: Pushed | None = None) -> QuantError:
    """One line for an upload that failed: what the Hub (its API, or its storage) or the network said, and how a
    re-run resumes (the same command; or, once a pull request was opened, the same with --revision refs/pr/N)."""
    import httpx2
    from huggingface_hub import errors

    cause = e
    while not isinstance(cause, (errors.HfHubHTTPError, httpx2.HTTPError, OSError)) and (
            cause.__cause__ or cause.__context__):
        cause = cause.__cause__ or cause.__context__
    response = getattr(cause, "response", None)
    status = getattr(response, "status_code", None)
    again = "no config.json was pushed; the same command resumes, sending only what the Hub lacks"
    if opened is not None:
        again = (f"no config.json was pushed to the pull request {opened.pull_request} it opened ({opened.url}); "
                 f"the same command with --revision {opened.pull_request} instead of --create-pr finishes it, "
                 f"sending only what the Hub lacks")
    request = getattr(response, "request", None) if status is not None else None
    url = str(getattr(request, "url", "") or "")
    if status in (401, 403) and url.startswith(endpoint):
        return QuantError(f"{target.repo_id}: the Hub refused the push ({status}): a write token for {target.repo_id} "
                          f"is needed (HF_TOKEN or `hf auth login`); {again}")
    if status is not None:
        detail = (getattr(cause, "server_message", None) or "").strip().splitlines()
        detail = f": {detail[0][:200]}" if detail else ""
        what = "the Hub" if url.startswith(endpoint) else "the Hub's storage"
        return QuantError(f"{target.repo_id}: the push failed, {what} answered {status}{detail} "
                          f"({getattr(request, 'method', '?')} {url.split('?')[0][:120]}); {again}")
    first = (str(cause).splitlines() or [""])[0][:200] or type(cause).__name__
    return QuantError(f"{target.repo_id}: the push failed ({type(cause).__name__}: {first}) talking to {endpoint}; "
                      f"{again}")
