"""`quant eval --card EXPORT`: put the paired accuracy result into the export's model card."""

from __future__ import annotations

import shutil
from pathlib import Path

from quant.errors import QuantError
from quant.pipeline.files import write_atomic
from quant.pipeline.model_card import CARD_FILE, accuracy_section, replace_accuracy

CARD_IMAGE = "eval_report.png"


def add_accuracy(export: Path, report: dict, report_dir: Path) -> Path:
    """Replace (or add) the accuracy section of export/README.md; copy report.png beside it. Returns the card."""
    card_path = Path(export) / CARD_FILE
    try:
        card = card_path.read_text() if card_path.exists() else f"# {Path(export).name}\n"
        image = None
        if (Path(report_dir) / "report.png").exists():
            shutil.copyfile(Path(report_dir) / "report.png", Path(export) / CARD_IMAGE)
            image = CARD_IMAGE
        write_atomic(card_path, replace_accuracy(card, accuracy_section(report, image)))
    except OSError as e:
        raise QuantError(f"{card_path}: cannot update the model card ({e.strerror or e})") from None
    return card_path
