"""The data sets eval tasks are asked on, and where each comes from: a local copy the user names (an EvalRequest
field, the `--option` of the same name), else the hub through `datasets` (`hub`: repo and config, those of
lm-eval's own task), else nowhere (`hub` None: the copy is always local, e.g. packaged with this project).

A task record names its source (`quant: data:`); several tasks may share one (GSM8K 5-shot and GSM8K boxed).
`format` says how the files look and how lm-eval reads them (evals/arms/data_files.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

EVAL_DATA_DIR = Path(__file__).resolve().parent.parent / "data"  # evals/data: the data packaged with the project


@dataclass(frozen=True)
class DataSource:
    name: str                       # what a task record's `data:` names
    what: str                       # the data set, in messages
    format: str                     # "gsm8k-jsonl" (train/test JSON lines, question/answer) | "gpqa-csv"
    local: str | None               # the EvalRequest field naming a local copy; None: the hub's only
    hub: tuple[str, str] | None     # (repo, config) loaded when no local copy is given; None: local only
    hint: str                       # what to pass for a local copy (the hub-offline error says it)

    @property
    def flag(self) -> str:
        return "--" + self.local.replace("_", "-") if self.local else f"{self.what} from the hub"

    def local_copy(self, request):
        """The local copy `request` names for this source, or None."""
        return getattr(request, self.local) if self.local else None


DATA_SOURCES: dict[str, DataSource] = {
    source.name: source
    for source in (
        DataSource("gsm8k", "GSM8K", "gsm8k-jsonl", "data_dir", ("openai/gsm8k", "main"),
                   "--data-dir DIR (train.jsonl and test.jsonl with question/answer)"),
        DataSource("gpqa_diamond", "GPQA-Diamond", "gpqa-csv", "gpqa_csv", ("Idavidrein/gpqa", "gpqa_diamond"),
                   "--gpqa-csv FILE (the gpqa_diamond CSV)"),
        # The trained demo toy's own arithmetic (evals/data/toy_arith), in GSM8K's format.
        DataSource("toy_arith", "toy arithmetic", "gsm8k-jsonl", "toy_data_dir", None,
                   "toy_data_dir (a GSM8K-format directory)"),
    )
}


def sources_of(tasks) -> list[DataSource]:
    """The data sources `tasks` are asked on, each once, in the tasks' order."""
    return [DATA_SOURCES[name] for name in dict.fromkeys(t.data for t in tasks)]
