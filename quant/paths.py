"""Where the project's data lives: the `manifests/` directory and the shared data directory."""

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MANIFESTS_DIR = Path(os.environ.get("QUANT_MANIFESTS_DIR", REPO_ROOT / "manifests"))
# The real GSM8K sets live beside the checkout (../shared/data); override with QUANT_DATA_DIR.
SHARED_DATA_DIR = Path(os.environ.get("QUANT_DATA_DIR", REPO_ROOT.parent / "shared" / "data"))
