"""An inert `torchvision` for the vLLM tier's probe (put on PYTHONPATH by tests_engines/cases.py, so vLLM's
architecture-inspection subprocess sees it too). vLLM's Qwen3.5 class imports transformers' Qwen2-VL image
processor, which imports torchvision at module level; the registry's torchvision does not import beside the local
CPU torch 2.13 build. Only image preprocessing uses it, and the tier sends token ids: every attribute is a class
that raises if it is ever called."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.28.0"


class _InertType(type):
    def __getattr__(cls, name):  # enum members and the like, read at import time (InterpolationMode.BICUBIC)
        if name.startswith("__"):
            raise AttributeError(name)
        return cls


class _Inert(metaclass=_InertType):
    def __init__(self, *args, **kwargs):
        raise RuntimeError("torchvision is a stub in the vLLM tier: image preprocessing is not available")


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        return importlib.machinery.ModuleSpec(name, self, is_package=True) if name.startswith("torchvision.") else None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Inert
