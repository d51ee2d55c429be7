"""The quantize pipeline: recipes → plan → execute → stage → self-check → publish.

`quantize_checkpoint` (quant/pipeline/run.py) is the entry point; `quant/pipeline/output.py` holds the output
directory's lifecycle (lock, temporaries, staging, publishing). This package only hands their names on.
"""

from quant.pipeline.output import COMPLETE_MARKER, MANIFEST_FILE, STAGING_DIR, TMP_DIR
from quant.pipeline.run import auto_devices, quantize_checkpoint

__all__ = ["quantize_checkpoint", "auto_devices", "COMPLETE_MARKER", "MANIFEST_FILE", "STAGING_DIR", "TMP_DIR"]
