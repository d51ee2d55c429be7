"""The README's offline Hub workflow (issue #50 item 6), run as written: a toy served by tests/hub_server.py, its
preflight, a streamed quantize within --max-disk, the export's preflight and its push, each exiting 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def readme_block() -> str:
    text = (REPO / "README.md").read_text()
    block = text.split("<!-- offline-hub:start -->", 1)[1].split("<!-- offline-hub:end -->", 1)[0]
    return re.search(r"```bash\n(.*?)```", block, re.S).group(1)


def test_the_readme_offline_hub_workflow_runs_as_written(tmp_path):
    script = readme_block().replace("python tests/hub_server.py", f"{sys.executable} {REPO / 'tests' / 'hub_server.py'}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    # the server is stopped however the block ends (a failed step, the timeout), so no pipe stays open
    script = "trap 'kill $(jobs -p) 2>/dev/null' EXIT\n" + script
    run = subprocess.run(["bash", "-ec", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "pushed 15 files" in run.stdout and "peak source on disk" in run.stderr
    assert (tmp_path / "toy-mxfp4" / "config.json").is_file()
