"""The transformers tier's reference, computed by the transformers the tier's engine runs (.venv-quark: 5.23), not
by the project venv's: teacher-forced log-probabilities of a plain checkpoint (the dequantized export, or the BF16
toy), the inputs of the listed linears MXFP4 quantize-dequantized (tests_engines/cases.py transformers_logprobs, the
W4A4 reference). Two transformers releases may run one family's model differently (GLM-5.3-Flash: the same
dequantized export scored 0.020 apart by 5.23 and 5.24, and 0.0 apart from transformers+Quark on 5.23), so the
reference must be the engine's own model code. Prints one JSON line: {"logprobs": [[...], ...]}.

    python reference_probe.py CHECKPOINT PROMPTS_JSON QDQ_MODULES_JSON
"""

from __future__ import annotations

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def preload() -> None:
    """What the zygote (zygote.py) imports once before forking a child per checkpoint."""
    sys.path.insert(0, REPO)
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import tests_engines.cases  # noqa: F401


def main() -> int:
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from pathlib import Path

    from tests_engines.cases import transformers_logprobs

    path, prompts, qdq = sys.argv[1], json.loads(sys.argv[2]), set(json.loads(sys.argv[3]))
    print(json.dumps({"logprobs": transformers_logprobs(Path(path), prompts, qdq)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
