#!/usr/bin/env bash
# The wheels scripts/device_check.sh installs on the GPU box (Python 3.12, x86_64; no network there): transformers,
# huggingface_hub, typer, rich, pyyaml and accelerate at the lock's releases with what they need, less what the
# device image has (torch, numpy). About 30 MB, carried as .device-wheels/ (the run's carry; the repository and
# these stay under its 64 MiB). DEVICE_PYTHON=3.11 makes the same set for a local rehearsal in a 3.11 venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${DEVICE_PYTHON:-3.12}
rm -rf .device-wheels && mkdir .device-wheels
want() { grep -i "^$1==" constraints.txt; }
grep -v '^#' constraints.txt | grep -v -i -E '^(torch|numpy)==' > /tmp/device-constraints.txt
get() {
    python3 -m pip download -q --only-binary :all: --python-version "$PYV" --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any \
        -c /tmp/device-constraints.txt -d .device-wheels "$@"
}
get "$(want transformers)" "$(want huggingface_hub)" "$(want typer)" "$(want rich)" "$(want pyyaml)" \
    "$(want safetensors)" "$(want psutil)"
get --no-deps "$(want accelerate)"  # it asks for torch, which the device image has
rm -f .device-wheels/numpy-*.whl .device-wheels/torch-*.whl .device-wheels/nvidia_*.whl
du -sh .device-wheels
