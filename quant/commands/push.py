"""`quant push EXPORT ORG/NAME`: upload a finished, verified export with its model card (quant.pipeline.push)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer


def command(
    export: Path = typer.Argument(..., help="A finished export of `quant quantize` (its config.json published)."),
    repo: str = typer.Argument(..., help="The Hub model repository ORG/NAME to upload it to: a new or empty one "
                                         "(created when missing) or one holding this export's earlier push, never "
                                         "the export's source; a write token: HF_TOKEN or `hf auth login`."),
    force: bool = typer.Option(False, "--force", help="Push even when the preflight finds errors an engine would "
                                                      "hit (they are printed as a warning)."),
    engine: Optional[List[str]] = typer.Option(None, "--engine", "-e",
                                               help="Engines the preflight checks (as verify-manifest's --engine); "
                                                    "default: those the export's scheme loads in."),
    private: bool = typer.Option(False, "--private", help="Create the repository private (when it is created)."),
    progress: bool = typer.Option(True, help="Show huggingface_hub's upload progress."),
    token: Optional[str] = typer.Option(None, "--token", help="A Hub token with write access, instead of HF_TOKEN "
                                        "or `hf auth login`'s (as `hf upload --token`)."),
    commit_message: Optional[str] = typer.Option(None, "--commit-message", help="The summary of the push's commits "
                                                 "(each adds what it holds: the weights first, config.json last); "
                                                 "default: 'moe-quant export'."),
    revision: Optional[str] = typer.Option(None, "--revision", metavar="BRANCH", help="Push to this branch "
                                           "(created from main when missing, as `hf upload --revision`), or to a "
                                           "pull request's refs/pr/N to finish one --create-pr opened."),
    create_pr: bool = typer.Option(False, "--create-pr", help="Open a pull request against main with the export "
                                   "instead of committing to main (as `hf upload --create-pr`)."),
) -> None:
    """Upload a finished export (shards, index, config.json, manifest, model card, tokenizer files; never the
    tool's scratch) to the Hub, after the preflight passes; an interrupted push resumes when run again. A
    repository holding a file that is neither this export's nor written by its earlier push is refused, and so is
    the export's source: nothing uploaded."""
    from quant.ownership import held
    from quant.pipeline.push import finished_export, preflight, push_target, refuse_source, upload

    target = push_target(repo, revision, create_pr)
    with held(export):
        found = finished_export(export)
        refuse_source(found, target)  # before the preflight: no repository's own source is pushed over
        if found.card_edited:
            typer.echo(f"note: {export / 'README.md'} was edited since the export: uploaded as it stands", err=True)
        preflight(found, engine, force, log=lambda m: typer.echo(m, err=True))
        pushed = upload(found, target, private=private, progress=progress, token=token, message=commit_message,
                        create_pr=create_pr)
    if pushed is None:
        typer.echo(f"{target.label} already holds the {len(found.files)} files of {export}: nothing to push")
    else:
        into = f" as pull request {pushed.pull_request}" if pushed.pull_request else ""
        typer.echo(f"pushed {len(found.files)} files ({found.bytes / 1e6:.1f} MB) of {export} to {target.label}"
                   f"{into}: {pushed.url}")
