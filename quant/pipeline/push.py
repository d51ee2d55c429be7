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

The upload is huggingface_hub's `upload_folder`: from huggingface_hub 2.x on, its resumable large-folder upload
(`upload_large_folder` before; over the Hub's Xet storage when hf_xet is installed: a re-run skips committed
files and sends no chunk the Hub already holds; without hf_xet, LFS: a re-run skips every blob the Hub already
holds). A repository that already holds every file of the export, and no other weights, gets nothing. Otherwise
everything but config.json goes first, with the deletion of the repository's earlier config.json, and config.json
in a commit of its own after it, with the deletion of the repository's `*.safetensors` the export does not have (an
earlier export's shards of other names): the repository never holds a config.json whose shards are not all there
(as OUT never does locally), and its weights end as the export's.
"""

from __future__ import annotations

import glob
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from quant.errors import EngineFailure, QuantError, machine_failure
from quant.files import sha256_file
from quant.hub import REPO_REF, HubRef
from quant.ownership import read_record, real_path, regular_file, unchanged
from quant.pipeline.model_card import CARD_FILE
from quant.pipeline.output import COMPLETE_MARKER, MANIFEST_FILE

LAST = "config.json"  # uploaded after everything else


@dataclass
class Export:
    """A finished export and the files of it that are published, with their size and sha256."""

    root: Path
    files: dict[str, tuple[int, str]]
    card_edited: bool = False

    @property
    def bytes(self) -> int:
        return sum(size for size, _ in self.files.values())

    def engines(self) -> list[str] | None:
        """The engines the export's scheme loads in (its manifest), for the preflight."""
        try:
            manifest = json.loads((self.root / MANIFEST_FILE).read_text())
            engines = manifest["engines"]["scheme_loads_in"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return list(engines) if isinstance(engines, list) and engines else None


def push_target(text: str) -> HubRef:
    """ORG/NAME of the repository to push to (a branch or revision is not pushed to)."""
    m = REPO_REF.match(text)
    if m is None or m.group("rev") or ".." in m.group("repo") or "--" in m.group("repo"):
        raise QuantError(f"{text}: not a Hub repository id to push to (ORG/NAME, no @REVISION: a push goes to the "
                         f"repository's main branch)")
    return HubRef(m.group("repo"))


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
    from quant.verify import verify_checkpoint
    from quant.verify.scales import scan_scales

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


def upload(export: Export, target: HubRef, private: bool = False, progress: bool = True) -> str | None:
    """Upload the export's published files to `target` (created when missing); returns the URL of the last
    commit, None when the repository already holds the export. While anything differs, the first commit (every
    file but config.json) deletes the repository's config.json and the last adds the export's, with the deletion of
    the repository's weights the export does not have (an earlier push's shards of other names): a config.json on
    the Hub means the rest is there. Network and Hub failures are one line (exit 2): the same command resumes."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    api = HfApi(endpoint=constants.ENDPOINT)
    names = sorted(export.files)
    (enable_progress_bars if progress else disable_progress_bars)()
    try:
        api.create_repo(target.repo_id, private=private, exist_ok=True)
        remote = remote_files(api, target)
        stale = [f for f in remote if f.endswith(".safetensors") and f not in export.files]
        if not stale and all(n in remote and remote[n] == local_oid(export, n, remote[n]) for n in names):
            return None
        info = None
        for batch, gone, message in (([n for n in names if n != LAST], [LAST] if LAST in remote else None,
                                       "weights, index, manifest, model card and side files"),
                                      ([LAST], stale, "config.json (the export is complete)")):
            info = api.upload_folder(repo_id=target.repo_id, folder_path=export.root,
                                     allow_patterns=[glob.escape(n) for n in batch],
                                     delete_patterns=[glob.escape(n) for n in gone] if gone else None,
                                     commit_message=f"moe-quant export: {message}")
    except Exception as e:  # noqa: BLE001  (huggingface_hub and httpx raise many types; push_error sorts them)
        machine = machine_failure(e)
        if machine is not None:
            raise machine from None  # reading the export failed: the machine (exit 74, the path named)
        raise push_error(e, target, api.endpoint) from None
    return info.commit_url


def remote_files(api, target: HubRef) -> dict[str, str]:
    """The repository's files on its main branch: path -> the sha256 of an LFS file, the git blob id of another."""
    from huggingface_hub.hf_api import RepoFile

    return {e.path: (e.lfs.sha256 if e.lfs else e.blob_id)
            for e in api.list_repo_tree(target.repo_id, recursive=True) if isinstance(e, RepoFile)}


def local_oid(export: Export, name: str, remote: str) -> str:
    """The export's file `name` as the repository names its content: its sha256 where the repository holds it as
    an LFS file (`remote` a 64-digit id), else its git blob id (regular files are small)."""
    if len(remote) == 64:
        return export.files[name][1]
    data = (export.root / name).read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def push_error(e: BaseException, target: HubRef, endpoint: str) -> QuantError:
    """One line for an upload that failed: what the Hub (its API, or its storage) or the network said, and that a
    re-run resumes."""
    import httpx2
    from huggingface_hub import errors

    cause = e
    while not isinstance(cause, (errors.HfHubHTTPError, httpx2.HTTPError, OSError)) and (
            cause.__cause__ or cause.__context__):
        cause = cause.__cause__ or cause.__context__
    response = getattr(cause, "response", None)
    status = getattr(response, "status_code", None)
    again = "no config.json was pushed; the same command resumes, sending only what the Hub lacks"
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
