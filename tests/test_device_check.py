"""scripts/device_check.sh --cpu-smoke: the GPU box's prepared check runs every step at toy width on the CPU and
writes its JSON of raw figures, so the script the device run depends on cannot rot (issue #44)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_device_check_runs_every_step_at_toy_width(tmp_path):
    out = tmp_path / "device-check.json"
    proc = subprocess.run(["bash", "scripts/device_check.sh", "--cpu-smoke", "--out", str(out), "--work",
                           str(tmp_path / "work")], cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**__import__("os").environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    steps = report["steps"]
    assert report["mode"] == "cpu-smoke" and all(s["ok"] for s in steps.values()), steps
    assert set(steps) == {"cuda_tests", "rtn_throughput", "gptq_layer", "gptq_toy"}
    layer = steps["gptq_layer"]
    assert set(layer["phases_s"]) >= {"gptq_calibration_s", "gptq_hessians_s", "gptq_solve_s", "gptq_forward_s"}
    assert layer["predicted_peak_bytes"] and layer["export_bytes"] > 0 and layer["peak_device_bytes"] is None
    assert steps["rtn_throughput"]["device_bytes_per_s"] > 0 and steps["gptq_toy"]["cpu"]["seconds"] > 0
