"""`quant eval --card EXPORT`: put the paired accuracy result into the export's model card."""

from __future__ import annotations

from pathlib import Path

from quant.errors import QuantError
from quant.files import write_atomic
from quant.ownership import NotOurs, read_record, real_path, unchanged, update_record
from quant.pipeline.model_card import CARD_FILE, accuracy_section, replace_accuracy

CARD_IMAGE = "eval_report.png"


def check_card_target(export: Path) -> None:
    """`--card` writes only into a model card quant quantize wrote: an export of this tool (its checked owner
    record) whose README.md (and eval_report.png) still hold what this tool wrote, never into any other file."""

    export = Path(export)
    if not export.is_dir():
        raise QuantError(f"--card {export}: not a directory (give the export whose README.md to update)")
    try:
        record = read_record(real_path(export))
    except NotOurs as e:
        raise QuantError(f"--card {export}: {e}") from None
    if record is None or record.kind != "quantize":
        raise QuantError(f"--card {export}: not an export written by quant quantize; --card only updates the model "
                         f"cards this tool wrote")
    for name in (CARD_FILE, CARD_IMAGE):
        if (export / name).exists() or (export / name).is_symlink():
            entry = record.files.get(name)
            if entry is None or not unchanged(real_path(export), name, entry):
                raise QuantError(f"--card {export / name}: changed since this tool wrote it (or not written by it); "
                                 f"nothing is overwritten: move it away and run again")


def add_accuracy(export: Path, report: dict, report_dir: Path) -> Path:
    """Replace (or add) the accuracy section of export/README.md; copy report.png beside it; record both in the
    export's owner record. Returns the card. `report`: the report as report.json holds it (`EvalReport.to_json()`),
    the form quant's model card reads."""

    check_card_target(export)
    card_path = Path(export) / CARD_FILE
    card = card_path.read_text() if card_path.exists() else f"# {Path(export).name}\n"
    written = [CARD_FILE]
    image = None
    if (Path(report_dir) / "report.png").exists():
        write_atomic(Path(export) / CARD_IMAGE, (Path(report_dir) / "report.png").read_bytes())
        image = CARD_IMAGE
        written.append(CARD_IMAGE)
    write_atomic(card_path, replace_accuracy(card, accuracy_section(report, image)))
    update_record(Path(export), written, kind="quantize")
    return card_path
