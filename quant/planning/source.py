"""Where the source checkpoint comes from: a local directory, or a Hugging Face hub id when online."""

from __future__ import annotations

import os
import re
from pathlib import Path

from quant.errors import QuantError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "tokenizer*"]


def resolve_source(src: str | Path) -> tuple[Path, str]:
    """(local directory, reference recorded in the manifest)."""
    path = Path(src)
    if path.is_dir():
        return path, str(path.resolve())
    text = str(src)
    if not HUB_ID.match(text) or path.exists():
        raise QuantError(f"{src}: not a checkpoint directory")
    if os.environ.get("HF_HUB_OFFLINE") in ("1", "true", "True"):
        raise QuantError(f"{src}: not a local directory, and the Hugging Face hub is offline (HF_HUB_OFFLINE=1)")
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(text, allow_patterns=HUB_PATTERNS)
    except Exception as e:  # network errors come in many types; the first line says what happened
        raise QuantError(f"{src}: cannot fetch from the Hugging Face hub (offline or no access: "
                         f"{str(e).splitlines()[0][:160]})") from None
    return Path(local), f"hf://{text}"
