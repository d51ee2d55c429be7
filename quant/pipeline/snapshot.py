"""A Hub source downloaded before the run (`--no-stream`, and GPTQ, which calibrates from the whole checkpoint):
the repository at the commit its ref names (`ORG/NAME[@REV]`) in huggingface_hub's cache, every file checked
against the sha256 the Hub lists for it before anything reads it.

The cache is huggingface_hub's, shared with every other program: a file there may have been cut short, edited or
flipped by the disk since it was fetched, and huggingface_hub trusts it by name. Here each LFS file of the snapshot
is hashed on every run that uses it; one that differs is fetched anew (`force_download`), and one that still
differs is one line naming its cache path (exit 2). `--max-disk` counts the whole repository's files the run
reads (they all lie in the cache at once): a repository bigger than it is refused before any download, with the
figure. A disk that fills under HF_HOME is exit 74 naming the path (quant.errors.machine_failure)."""

from __future__ import annotations

import fnmatch
import warnings
from pathlib import Path

from quant.errors import QuantError
from quant.files import sha256_file
from quant.hub import HubRef, cache_failure, cached_as_listed, explain, open_hub_checkpoint
from quant.pipeline.source_files import source_reference
from quant.planning.source import HUB_PATTERNS


def cached_source(ref: HubRef, max_disk: int | None = None, log=print) -> tuple[Path, str]:
    """(the snapshot directory in the HF cache, every file verified; the source as the manifest records it)."""
    hub = open_hub_checkpoint(ref)  # the commit, the file list with sizes and sha256s; one line when unreachable
    try:
        files = sorted(f for f in hub.sizes if any(fnmatch.fnmatchcase(f, p) for p in HUB_PATTERNS))
        need = sum(hub.file_size(f) for f in files)
        if max_disk is not None and need > max_disk:
            raise QuantError(f"--max-disk {_size(max_disk)}: downloading {ref.label} first (--no-stream) puts "
                             f"{_size(need)} of its files in the Hugging Face cache; give at least that, or stream "
                             f"it (without --no-stream; round to nearest only)")
        local = Path(_snapshot(hub, ref, files))
        for file in files:
            _verified(hub, ref, local, file, log)
    finally:
        hub.close()
    return local, source_reference(ref)


def _snapshot(hub, ref: HubRef, files: list[str]) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    quiet = are_progress_bars_disabled()
    disable_progress_bars()  # the run's own lines say what happens; a failure is one line, not a bar and a warning
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Not enough free disk space": the OSError that follows says it
            return snapshot_download(ref.repo_id, revision=hub.commit, allow_patterns=files)
    except Exception as e:  # noqa: BLE001  (huggingface_hub and httpx raise many types)
        _raise(e, ref, hub)
    finally:
        if not quiet:
            enable_progress_bars()


def _verified(hub, ref: HubRef, local: Path, file: str, log) -> None:
    """Check `file` of the snapshot against the Hub's sha256 (an LFS file) or git blob id (a small file); fetch it
    anew once when it differs."""
    expected = hub.lfs_sha256.get(file)
    path = local / file
    if expected is None:  # a small file: the git blob id the Hub lists (quant.hub reads config and index so too)
        if not cached_as_listed(path, hub.repo.blob_ids.get(file)):
            _refetch(hub, ref, file)
        return
    if sha256_file(path) == expected:
        return
    log(f"{path}: the cached file does not match the Hub's sha256 for {ref.label}/{file}; fetching it again")
    _refetch(hub, ref, file)
    if sha256_file(path) != expected:
        raise QuantError(f"{path.resolve()}: still not the Hub's sha256 of {ref.label}/{file} after a fresh "
                         f"download; nothing was quantized (check the disk under HF_HOME, then run again)")


def _refetch(hub, ref: HubRef, file: str) -> None:
    from huggingface_hub import hf_hub_download

    try:
        hf_hub_download(ref.repo_id, file, revision=hub.commit, force_download=True)
    except Exception as e:  # noqa: BLE001
        _raise(e, ref, hub, file)


def _raise(e: BaseException, ref: HubRef, hub, file: str | None = None):
    raise cache_failure(e) or explain(e, ref, hub.endpoint, file) from None


def _size(n: int) -> str:
    return f"{n / 1e9:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"
