"""`quant eval --card EXPORT`: put the paired accuracy result into the export's model card."""

from __future__ import annotations

import shutil
from pathlib import Path

from quant.errors import QuantError
from quant.pipeline.files import write_atomic
from quant.pipeline.model_card import CARD_FILE, accuracy_section, replace_accuracy

CARD_IMAGE = "eval_report.png"


def check_card_target(export: Path) -> None:
    """`--card` writes only into a model card quant quantize wrote: an export of this tool (its owner record or
    completion marker), never into any README.md."""
    from quant.ownership import read_owner
    from quant.pipeline.output import COMPLETE_MARKER

    export = Path(export)
    if not export.is_dir():
        raise QuantError(f"--card {export}: not a directory (give the export whose README.md to update)")
    owner = read_owner(export)
    if not ((owner and owner.get("kind") == "quantize") or (export / COMPLETE_MARKER).is_file()):
        raise QuantError(f"--card {export}: not an export written by quant quantize; --card only updates the model "
                         f"cards this tool wrote")


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
