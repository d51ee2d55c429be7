"""Run by tests/test_hub_every_family.py with HF_ENDPOINT at its test hub:

    python tests/hub_family_run.py ORG/NAME WORKDIR

preflights ORG/NAME (the source) and ORG/NAME-mx (its export), quantizes ORG/NAME streamed into WORKDIR/streamed
and with --no-stream into WORKDIR/no-stream (no self-check: the preflights compare), and prints one JSON line:
{"source": {"exit", "report"}, "export": {...}, "streamed_source", "scale_scan_bytes"}."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from quant.hub import hub_reference, open_hub_checkpoint
from quant.pipeline import quantize_checkpoint
from quant.verify import verify_checkpoint


def preflight(repo: str) -> dict:
    """What `quant verify-manifest ORG/NAME` reports: the repository read over HTTP, headers only."""
    hub = open_hub_checkpoint(hub_reference(repo))
    try:
        report = verify_checkpoint(hub)
    finally:
        hub.close()
    return {"exit": report.exit_code, "report": report.to_json()}


def main() -> int:
    repo, work = sys.argv[1], Path(sys.argv[2])
    quiet = lambda *a: None  # noqa: E731
    streamed = quantize_checkpoint(repo, work / "streamed", check_engines=[], stream=True, log=quiet)
    quantize_checkpoint(repo, work / "no-stream", check_engines=[], stream=False, log=quiet)
    print(json.dumps({"source": preflight(repo), "export": preflight(f"{repo}-mx"),
                      "streamed_source": streamed["stream"] and json.loads(
                          (work / "streamed" / "quant_manifest.json").read_text())["source"]["checkpoint"],
                      "scale_scan_bytes": streamed["timing"]["scale_scan_bytes"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
