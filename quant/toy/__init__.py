"""Toy checkpoints: tiny seeded models with a released checkpoint's config keys, tensor names and dtypes
(`quant toy NAME OUT`), the pipeline's test material on every family.

build.py builds one (through transformers, or layout.py for a family transformers has no class for) and writes
it in the release's storage; release.py adds what a release ships beside the transformers model; tokenizer.py is
the byte-level tokenizer every toy shares. The specs are data: manifests/toys/<family>.yaml beside each family's
record, and manifests/toys.yaml for what all toys share. Importing this package reads only YAML (no torch), so
`quant --help` stays fast."""

from quant.toy.build import (TOY_NAMES, TOYS_MANIFEST, build_toy, parse_shard_size, source_format_spec,
                             source_formats, toy_family, toy_tokenizer, write_safetensors)

__all__ = ["TOY_NAMES", "TOYS_MANIFEST", "build_toy", "parse_shard_size", "source_format_spec", "source_formats",
           "toy_family", "toy_tokenizer", "write_safetensors"]
