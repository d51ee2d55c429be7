"""`quant toy NAME OUT`: write a tiny seeded checkpoint of a supported MoE family (tests, demos, CI)."""

from __future__ import annotations

import hashlib
import json
import secrets
import shutil
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import typer

import quant
from quant.paths import MANIFESTS_DIR, cache_root
from quant.toy import TOY_NAMES, build_toy, parse_shard_size, source_format_spec, source_formats, toy_family

# Every toy manifests/toys.yaml defines (quant.toy reads only YAML at import: no torch on `--help`).
NAMES_HELP = ", ".join(TOY_NAMES)
FORMATS_HELP = ", ".join(f"{k} ({v['release']})" for k, v in source_formats().items())


def command(
    name: str = typer.Argument(..., help=f"Toy family: {NAMES_HELP}."),
    out: Path = typer.Argument(..., help="Output directory: new, empty, or an earlier toy of the same options "
                               "(replaced); anything else needs --overwrite."),
    fp8_block: bool = typer.Option(False, "--fp8-block", help="Write an official-style block-FP8 source "
                                   "(float8_e4m3fn weights + weight_scale_inv, 128x128 blocks)."),
    shard_size: str = typer.Option(None, "--shard-size", help="Split weights into shards of at most this size "
                                   "(bytes, or e.g. 500KB, 2MB) and write model.safetensors.index.json."),
    source_format: str = typer.Option(None, "--source-format", help=f"Store the weights as a release in this "
                                      f"format stores them: {FORMATS_HELP} (README: Microscaled sources)."),
    seed: int = typer.Option(0, "--seed", help="Random seed; the same seed gives byte-identical files."),
    overwrite: bool = typer.Option(False, "--overwrite",
                                   help="Replace an earlier output of this tool (another toy, an export), or write "
                                   "into a directory this tool did not make (files it did not write are never deleted "
                                   "or overwritten)."),
) -> None:
    """Write a tiny seeded checkpoint with the family's real tensor names, config and a byte-level tokenizer."""
    path = write_toy(name, out, fp8_block=fp8_block, shard_size=shard_size, seed=seed, overwrite=overwrite,
                     source_format=source_format)
    from quant.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(path)
    size = sum(info.nbytes for info in checkpoint.tensors.values())

    variant = source_format or ("block-FP8" if fp8_block else toy_family(name).release_format or "BF16")
    typer.echo(f"{name} ({variant}, seed {seed}) -> {path}: {len(checkpoint.tensors)} tensors, "
               f"{len(checkpoint.files)} shard(s), {size / 1e6:.2f} MB")


def write_toy(name: str, out: Path, *, fp8_block: bool = False, shard_size=None, seed: int = 0,
              overwrite: bool = False, source_format: str | None = None) -> Path:
    """`build_toy` under the ownership rule (quant.ownership): into a new or empty directory, or over an earlier
    toy of the same options; anything else needs `overwrite`, and only files of ours are replaced."""

    from quant.ownership import claim

    toy_family(name)  # an unknown name, format or a bad size is refused before anything is written
    source_format_spec(source_format)
    parse_shard_size(shard_size)
    identity = {"toy": name, "seed": seed, "fp8_block": fp8_block, "shard_size": shard_size}
    if source_format:
        identity["source_format"] = source_format
    cached = toy_cache(identity)
    with claim(out, "toy", identity=identity, overwrite=overwrite) as held:
        staging = held.root / f".quant-toy-{secrets.token_hex(4)}"  # scratch of ours (quant.ownership.SCRATCH)
        try:
            if not _copy_cached(cached, staging):
                build_toy(name, staging, fp8_block=fp8_block, shard_size=shard_size, seed=seed, in_place=True,
                          source_format=source_format)
                _keep(staging, cached)
            held.replace_with(staging)
        finally:
            if staging.exists():
                shutil.rmtree(staging)
    return out


# A toy is the same bytes for the same options, code and libraries, so one built before is copied, not built again:
# building imports torch and the family's transformers model (about 3.4 of the 3.7 s `quant toy glm5` takes on a
# 2-core Xeon), copying does neither. The key covers the options, every file of this package (code and manifests,
# QUANT_MANIFESTS_DIR's too) and the versions of the libraries a toy is built with; a cached file whose sha256 is
# not the one recorded when it was kept is never copied (the toy is built again).
CACHED = ".toy-sha256.json"


def toy_cache(identity: dict) -> Path:
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode())
    for root in dict.fromkeys([Path(quant.__file__).parent, MANIFESTS_DIR]):
        for path in sorted(root.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    for dist in ("torch", "transformers", "tokenizers", "safetensors"):
        try:
            digest.update(f"{dist}=={version(dist)}".encode())
        except PackageNotFoundError:
            digest.update(dist.encode())
    return cache_root() / "toys" / digest.hexdigest()[:32]


def _copy_cached(cached: Path, staging: Path) -> bool:
    """Copy a kept toy into `staging` (True), or nothing (False: none kept, or a file not as recorded)."""

    from quant.files import sha256_file

    try:
        recorded = json.loads((cached / CACHED).read_text())
        files = sorted(p.name for p in cached.iterdir() if p.name != CACHED)
        if files != sorted(recorded) or any(sha256_file(cached / n) != recorded[n] for n in files):
            return False
        staging.mkdir()
        for name in files:
            shutil.copyfile(cached / name, staging / name)
        return True
    except (OSError, ValueError, TypeError):
        if staging.exists():
            shutil.rmtree(staging)
        return False


def _keep(staging: Path, cached: Path) -> None:
    """Keep a built toy in the cache (atomically); a cache that cannot be written is skipped, never an error."""

    from quant.files import sha256_file

    scratch = cached.parent / f".{cached.name}-{secrets.token_hex(4)}"
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(staging, scratch)
        (scratch / CACHED).write_text(json.dumps({p.name: sha256_file(p) for p in sorted(staging.iterdir())}))
        if cached.exists():  # another run kept the same toy meanwhile
            shutil.rmtree(scratch)
        else:
            scratch.replace(cached)
    except OSError:
        shutil.rmtree(scratch, ignore_errors=True)
