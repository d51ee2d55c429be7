#!/usr/bin/env bash
# The GPU box's one prepared check (issue #44; scripts/device_check.py says what it measures). On the device
# machine (Python 3.12, torch with CUDA, transformers, safetensors, typer, huggingface_hub, pytest, numpy there):
# the wheels the package needs beyond those travel in .device-wheels/ (scripts/device_wheels.sh makes them here;
# pass it in the run's carry), are installed into a venv that sees the system's torch, and the check writes
# device-check.json. `--cpu-smoke` runs the same steps at toy width on the CPU of this machine (make test does).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--cpu-smoke" ]; then
    exec "${PYTHON:-python3}" scripts/device_check.py "$@"
fi
OUT=${OUT:-.}
if [ -d .device-wheels ]; then
    python3 -m venv --system-site-packages /tmp/device-venv
    /tmp/device-venv/bin/python -m pip install -q --no-index --find-links .device-wheels --no-deps .device-wheels/*.whl
    PY=/tmp/device-venv/bin/python
else
    PY=python3
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
exec "$PY" scripts/device_check.py --out "$OUT/device-check.json" "$@"
