"""What an engine release can parse, read from its own wheel (issue #42 item 1): the transformers releases it admits
(its METADATA's Requires-Dist) and the model types it parses with config classes of its own (SGLang's
`_CONFIG_REGISTRY` in srt/utils/hf_transformers/common.py with the aliases assigned after it; vLLM's
`_CONFIG_REGISTRY` in transformers_utils/config.py), and, from transformers' own wheels, the first transformers
release whose AutoConfig knows each model type of our families. A release file's `transformers` and
`config_registry` keys and the families' `transformers_since` are this script's output; the one checker,
scripts/check_engine_profile.py --wheels WHEELS, compares them with the data.

    python -m pip download --no-deps --only-binary :all: -d WHEELS sglang==0.5.23 vllm==0.32.0 transformers==5.16.1 ...
    python scripts/release_parsing.py WHEELS                  # print the facts of every wheel there
    python scripts/check_engine_profile.py --wheels WHEELS    # exit 1 when the engine files / families say otherwise

Reading is static (zip entries and regular expressions), so it runs for any release without installing it.
"""

from __future__ import annotations

import argparse
import glob
import re
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WHEEL = re.compile(r"(?P<name>[a-z_]+)-(?P<version>[\d.]+)-")


def _wheel_id(path: str) -> tuple[str, str]:
    m = WHEEL.match(Path(path).name)
    return m.group("name"), m.group("version")


def requirement(z: zipfile.ZipFile, package: str) -> str | None:
    """The Requires-Dist specifier of `package` in the wheel's METADATA (e.g. '==5.6.0', '<5.18.0,>=5.10.4')."""
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        m = re.match(rf"Requires-Dist: {package}\s*(\(?[^;]*\)?)", line, re.I)
        if m:
            return m.group(1).strip("() ") or None
    return None


def _class_model_types(z: zipfile.ZipFile, prefix: str) -> dict[str, str]:
    """Config class name -> its model_type, from every `class X(...): model_type = "y"` under `prefix`."""
    out = {}
    for name in z.namelist():
        if name.startswith(prefix) and name.endswith(".py"):
            text = z.read(name).decode(errors="replace")
            for cls, body in re.findall(r"^class (\w+)\([^)]*\):\n((?:[ \t]+.*\n|\n)*)", text, re.M):
                m = re.search(r'^\s+model_type\s*(?::\s*str)?\s*=\s*"([\w-]+)"', body, re.M)
                if m:
                    out[cls] = m.group(1)
    return out


def sglang_registry(z: zipfile.ZipFile) -> set[str]:
    src = z.read("sglang/srt/utils/hf_transformers/common.py").decode()
    block = re.search(r"_CONFIG_REGISTRY[^=]*=\s*\{.*?for cls in \[(.*?)\]", src, re.S).group(1)
    classes = re.findall(r"(\w+Config)\b", block)
    model_types = _class_model_types(z, "sglang/srt/configs/")
    found = {model_types[c] for c in classes if c in model_types}
    found |= set(re.findall(r'_CONFIG_REGISTRY\["([\w-]+)"\]\s*=', src))
    # 0.5.23: _CONFIG_REGISTRY.update({cls.model_type: cls for cls in DEEPSEEK_V41_CONFIG_CLASSES}), a tuple of the
    # module sglang/srt/configs/<module>.py imported above it: every model_type that module's classes declare.
    for tuple_name in re.findall(r"_CONFIG_REGISTRY\.update\(\s*\{cls\.model_type: cls for cls in (\w+)\}", src):
        module = re.search(rf"from sglang\.srt\.configs\.(\w+) import [^\n]*\b{tuple_name}\b", src).group(1)
        found |= set(re.findall(r'model_type = "([\w-]+)"', z.read(f"sglang/srt/configs/{module}.py").decode()))
    return found


def vllm_registry(z: zipfile.ZipFile) -> set[str]:
    src = z.read("vllm/transformers_utils/config.py").decode()
    block = src[src.index("_CONFIG_REGISTRY"):]
    block = block[:block.index("\n)\n")]
    return set(re.findall(r'^\s+([\w-]+)="\w+"', block, re.M)) | set(re.findall(r'"([\w-]+)":\s*"\w+Config"', block))


def transformers_model_types(z: zipfile.ZipFile) -> set[str]:
    names = set(z.namelist())
    src = z.read("transformers/models/auto/configuration_auto.py").decode()
    if "transformers/models/auto/auto_mappings.py" in names:
        src = z.read("transformers/models/auto/auto_mappings.py").decode()
    start = re.search(r"CONFIG_MAPPING_NAMES = OrderedDict[^(]*\(", src).start()
    block = src[start:]
    block = block[:block.index("\n)\n")]
    return set(re.findall(r'\(\s*"([\w-]+)",\s*"\w+"\s*\)', block))


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split("."))


def facts(wheels: Path) -> dict:
    engines, since = {}, {}
    tf = sorted(glob.glob(str(wheels / "transformers-*.whl")), key=lambda p: _version_key(_wheel_id(p)[1]))
    for path in tf:
        version = _wheel_id(path)[1]
        for model_type in transformers_model_types(zipfile.ZipFile(path)):
            since.setdefault(model_type, version)
    for path in sorted(glob.glob(str(wheels / "sglang-*.whl")) + glob.glob(str(wheels / "vllm-*.whl"))):
        name, version = _wheel_id(path)
        z = zipfile.ZipFile(path)
        registry = sglang_registry(z) if name == "sglang" else vllm_registry(z)
        engines[(name, version)] = {"transformers": requirement(z, "transformers"), "registry": registry}
    return {"engines": engines, "transformers_since": since,
            "transformers_checked": [_wheel_id(p)[1] for p in tf]}


def our_model_types() -> set[str]:
    from quant.families import all_families

    return {t for f in all_families() for t in f.model_types}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheels", type=Path, help="a directory of sglang-*, vllm-* and transformers-* wheels")
    args = parser.parse_args(argv)
    found = facts(args.wheels)
    types = our_model_types()
    for (engine, version), fact in sorted(found["engines"].items()):
        print(f"{engine}=={version}: transformers {fact['transformers']}; registers "
              f"{', '.join(sorted(types & fact['registry'])) or '-'}")
    print("transformers_since: " + ", ".join(f"{t} {v}" for t, v in sorted(found["transformers_since"].items())
                                              if t in types))
    return 0


if __name__ == "__main__":
    sys.exit(main())
