"""The environment `make test` runs in is the lock's (constraints.txt): every locked distribution that is installed
is at its locked release, the installer included (issue #49: pip and setuptools were left out of the lock, and
`pip install --upgrade pip` took whatever release was newest)."""

from __future__ import annotations

import importlib.metadata as metadata
from pathlib import Path

import pytest

LOCK = Path(__file__).resolve().parent.parent / "constraints.txt"


def _locked() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def test_the_lock_pins_the_installer():
    assert {"pip", "setuptools", "torch"} <= set(_locked())


@pytest.mark.parametrize("name", ["pip", "setuptools"])
def test_the_installer_is_the_locked_release(name):
    assert metadata.version(name) == _locked()[name]


def test_every_installed_locked_distribution_is_at_its_locked_release():
    wrong = {}
    for name, version in _locked().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # an extra this environment does not install
        if installed.split("+")[0] != version:
            wrong[name] = (installed, version)
    assert wrong == {}, wrong
