"""The MTP (multi-token prediction / NextN draft) layout of a checkpoint, read once from its family file and its
config.json: how many MTP layers the config declares and under which key, the number the engines give each one,
where they are stored, which of their modules stay BF16, how the in-process draft names its tensors, and whether
the release publishes them at all.

A family file says it in three sections, each read strictly here and nowhere else:

    mtp:              where the layers are stored and what counts them
      count_key         the config.json key (of the text config) counting them (default num_nextn_predict_layers)
      first_layer_key   stored as decoder layers {text}layers.{<first_layer_key> + k} (DeepSeek-V3, GLM), or
      namespace         stored under a namespace of their own (Qwen3.5 'mtp.': mtp.layers.{k}.*)
      keep              regexes of MTP modules every recipe keeps BF16
    mtp_draft:        the draft as the engines run it (quant/model_exec/mtp.py builds it in process): tensor-name
                      templates, or `unsupported` (why transformers cannot build its block)
    mtp_unpublished:  {reason}: the config declares MTP layers the family's releases never publish

The engines number MTP layer k as num_hidden_layers + k wherever it is stored (vLLM qwen3_5_mtp.py
`mtp_start_layer_idx = config.num_hidden_layers`, sglang/srt/models/deepseek_nextn.py), so `first` is that.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from quant.families.schema import BadData, check_keys

# The engines' NextN count: what SGLang's and vLLM's NextN drafts read (sglang/srt/configs/model_config.py
# `num_nextn_predict_layers`), and so the count of a family whose file names no other.
NEXTN_COUNT_KEY = "num_nextn_predict_layers"
# Every count key a family may name. Closed on purpose: config.json validation bounds each of them
# (quant/checkpoint.py), so a family counting its MTP layers under a new key must add it here.
COUNT_KEYS = (NEXTN_COUNT_KEY, "mtp_num_hidden_layers", "num_mtp_modules")

MTP_KEYS = ("count_key", "first_layer_key", "namespace", "keep")
DRAFT_NAME_KEYS = ("block", "embed_norm", "hidden_norm", "proj", "final_norm", "embed", "head")
MTP_DRAFT_KEYS = (*DRAFT_NAME_KEYS, "glue", "zero_embedding_at_position_0", "decoder_config", "unsupported")
MTP_UNPUBLISHED_KEYS = ("reason",)

# Where a family stores its MTP layers.
DECODER_STACK = "decoder stack"  # {text}layers.{N + k}.*
NAMESPACE = "namespace"          # a namespace of their own (mtp.*)
UNSTATED = "unstated"            # the family file does not say (generic families: DeepSeek-V4's engine rules do)


@dataclass(frozen=True)
class MtpDraft:
    """The in-process MTP draft's tensor-name templates (`{text}`: the language model's prefix, `{block}`: the
    block's, which is formatted with `{n}` = N + k and `{k}`), or only `unsupported` when transformers cannot
    build its block (the draft is then not run, and GPTQ rounds its weights to nearest)."""

    block: str = ""
    embed_norm: str = ""
    hidden_norm: str = ""
    proj: str = ""
    final_norm: str = ""
    embed: tuple[str, ...] = ()  # candidates, the first one stored is used
    head: tuple[str, ...] = ()
    glue: tuple[str, ...] = ()   # first name parts under `block` that are not the decoder layer's
    zero_embedding_at_position_0: bool = False
    # overrides of the one-layer block's config
    decoder_config: dict[str, Any] = field(default_factory=dict, hash=False)
    unsupported: str = ""


@dataclass(frozen=True)
class MtpSpec:
    """A family file's MTP sections, parsed and checked; `layout` applies them to a config."""

    count_key: str = NEXTN_COUNT_KEY
    first_layer_key: str | None = None
    namespace: str | None = None
    keep: tuple[re.Pattern[str], ...] = ()
    draft: MtpDraft | None = None
    unpublished: str | None = None  # why the family's releases publish none of the layers their config declares

    @property
    def storage(self) -> str:
        return DECODER_STACK if self.first_layer_key else NAMESPACE if self.namespace else UNSTATED

    def layout(self, text: dict[str, Any], family: str) -> MtpLayout:
        """The layout of a checkpoint whose text config (a wrapper's text_config merged in) is `text`."""
        first = text.get(self.first_layer_key or "num_hidden_layers")
        count = int(text.get(self.count_key) or 0)
        return MtpLayout(family=family, count_key=self.count_key, count=count if first is not None else 0,
                         first=int(first or 0), storage=self.storage, keep=self.keep, draft=self.draft,
                         unpublished=self.unpublished)


@dataclass(frozen=True)
class MtpLayout:
    """The MTP layers of one checkpoint (`quant.families.mtp_layout`).

    `count` layers, declared by config.json's `count_key` and numbered `first` .. `first + count - 1` (`indices`)
    as the engines number them. `storage` says where they are: DECODER_STACK (`decoder_layers`: planned as MTP
    layers, the recipe's mtp_layer and `keep` apply), NAMESPACE (planned by the family's roles), or UNSTATED.
    `unpublished`: the family's reason when its releases publish none of them (MiniMax-M2): no layer is then
    planned, built or checked as an MTP layer, and the eval refuses with `unpublished_line`."""

    family: str
    count_key: str
    count: int
    first: int
    storage: str
    keep: tuple[re.Pattern[str], ...] = ()
    draft: MtpDraft | None = None
    unpublished: str | None = None

    @property
    def indices(self) -> range:
        return range(self.first, self.first + self.count)

    @property
    def in_decoder_stack(self) -> bool:
        return self.storage == DECODER_STACK

    @property
    def published(self) -> range:
        """The declared layers the release can hold: none when the family publishes none."""
        return range(0) if self.unpublished else self.indices

    @property
    def decoder_layers(self) -> range:
        """The published layers stored as decoder layers {text}layers.{N + k}."""
        return self.published if self.in_decoder_stack else range(0)

    @property
    def nextn_layers(self) -> range:
        """The layers an engine's NextN draft looks for as model.layers.{N + k}: the published ones, unless the
        family stores them in a namespace (a family file that does not say gets the NextN convention,
        sglang/srt/models/deepseek_nextn.py)."""
        return range(0) if self.storage == NAMESPACE else self.published

    def keeps(self, module: str) -> bool:
        """Whether the family keeps MTP module `module` BF16 under every recipe (`mtp.keep`)."""
        return any(p.search(module) for p in self.keep)

    def block(self, k: int, text_prefix: str) -> str:
        """The checkpoint prefix of draft layer k's block."""
        if self.draft is None:
            raise ValueError(f"the {self.family} family names no MTP draft block")
        return self.draft.block.format(text=text_prefix, n=self.first + k, k=k)

    def unpublished_line(self, tensor_names: Iterable[str] = ()) -> str | None:
        """One line saying why this checkpoint has no MTP draft to run although its config declares one (the family
        publishes none and no tensor lies where they would); None when that is not the case."""
        if not self.unpublished or not self.count or any(self._holds_mtp(n) for n in tensor_names):
            return None
        return (f"config.json declares {self.count} MTP module(s) ({self.count_key}) but the {self.family} release "
                f"publishes no MTP weights ({self.unpublished}): there is no draft to measure; run without MTP "
                "(--no-mtp)")

    def _holds_mtp(self, name: str) -> bool:
        if ".mtp" in name or name.startswith("mtp."):
            return True
        return self.in_decoder_stack and any(f"layers.{i}." in name for i in self.indices)


def parse_mtp_spec(data: dict[str, Any], parent: MtpSpec | None, where: str) -> MtpSpec:
    """The MTP sections of family file `data` (at `where`), each inherited whole from `parent` when absent; an
    unknown key, a count key outside COUNT_KEYS or a draft without its names is a BadData naming the file."""
    spec = parent or MtpSpec()
    if "mtp" in data:
        spec = _with_storage(MtpSpec(draft=spec.draft, unpublished=spec.unpublished), data["mtp"], where)
    if "mtp_draft" in data:
        spec = _replace(spec, draft=_draft(data["mtp_draft"], where))
    if "mtp_unpublished" in data:
        section = check_keys(data["mtp_unpublished"], MTP_UNPUBLISHED_KEYS, where, "mtp_unpublished")
        if section and not isinstance(section.get("reason"), str):
            raise BadData(f"{where}: mtp_unpublished needs a reason (why the release publishes no MTP weights)")
        spec = _replace(spec, unpublished=section.get("reason") if section else None)
    return spec


def _with_storage(spec: MtpSpec, section: Any, where: str) -> MtpSpec:
    """`spec` with the `mtp` section's count key, storage and keep patterns (null: none of them)."""
    section = check_keys(section, MTP_KEYS, where, "mtp")
    count_key = section.get("count_key", NEXTN_COUNT_KEY)
    if count_key not in COUNT_KEYS:
        raise BadData(f"{where}: mtp.count_key {count_key!r} is not one of {', '.join(COUNT_KEYS)} (add a new key to "
                      "quant/families/mtp.py COUNT_KEYS, which config.json validation bounds)")
    if section and bool(section.get("first_layer_key")) == bool(section.get("namespace")):
        raise BadData(f"{where}: mtp needs one of first_layer_key (MTP layers stored as decoder layers) or "
                      "namespace (stored under their own prefix)")
    keep = section.get("keep") or []
    if not isinstance(keep, list) or not all(isinstance(p, str) for p in keep):
        raise BadData(f"{where}: mtp.keep must be a list of regexes")
    try:
        patterns = tuple(re.compile(p) for p in keep)
    except re.error as e:
        raise BadData(f"{where}: mtp.keep: invalid regex ({e})") from None
    return _replace(spec, count_key=count_key, first_layer_key=section.get("first_layer_key"),
                    namespace=section.get("namespace"), keep=patterns)


def _draft(section: Any, where: str) -> MtpDraft | None:
    section = check_keys(section, MTP_DRAFT_KEYS, where, "mtp_draft")
    if not section:
        return None
    missing = [k for k in DRAFT_NAME_KEYS if k not in section]
    if missing and not section.get("unsupported"):
        raise BadData(f"{where}: mtp_draft is missing {', '.join(missing)} (or says why it is unsupported)")
    return MtpDraft(
        block=section.get("block", ""), embed_norm=section.get("embed_norm", ""),
        hidden_norm=section.get("hidden_norm", ""), proj=section.get("proj", ""),
        final_norm=section.get("final_norm", ""), embed=tuple(section.get("embed") or ()),
        head=tuple(section.get("head") or ()), glue=tuple(section.get("glue") or ()),
        zero_embedding_at_position_0=bool(section.get("zero_embedding_at_position_0")),
        decoder_config=dict(section.get("decoder_config") or {}), unsupported=str(section.get("unsupported") or ""))


def _replace(spec: MtpSpec, **changes: Any) -> MtpSpec:
    return replace(spec, **changes)
