"""Strict reading of the project's YAML data (family files, recipes, toy configs): a key nobody reads is a
misspelling, and a misspelled key silently dropped is a recipe or family that does something else than it says.
Each reader lists the keys it understands; anything else raises QuantError naming the key and the file (the CLI
prints it as one line, exit code 2: bad input)."""

from __future__ import annotations

import difflib
from pathlib import Path

import yaml

from quant.errors import QuantError


class BadData(QuantError):
    """A data file (family, recipe, toy config) that cannot be used as written: exit code 2."""

    exit_code = 2


def load_yaml(path: Path) -> dict:
    """A YAML file whose top level is a mapping."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise BadData(f"{path}: file not found") from None
    except OSError as e:
        raise BadData(f"{path}: cannot read ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise BadData(f"{path}: invalid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise BadData(f"{path}: expected a mapping at the top level")
    return data


def check_keys(data: object, allowed, where: str, what: str = "") -> dict:
    """`data` as a mapping whose keys are all in `allowed`; BadData naming the first unknown key (with the
    closest allowed spelling) otherwise."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise BadData(f"{where}: {what or 'section'} must be a mapping, got {type(data).__name__}")
    allowed = list(allowed)
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known keys: {', '.join(allowed)})"
            raise BadData(f"{where}: unknown key {key!r}{' in ' + what if what else ''}{hint}")
    return data
