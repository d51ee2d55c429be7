"""README's architecture section is the import-linter contract (pyproject.toml), layer for layer, in order: the
picture a newcomer reads is the one `lint-imports` holds in `make test`."""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent


def contract_layers() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    first = next(c for c in config["contracts"] if c["type"] == "layers" and "quant.cli" in c["layers"])
    return [" | ".join(part.strip() for part in layer.split("|")) for layer in first["layers"]]


def readme_layers() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = text.split("## Architecture", 1)[1].split("```\n", 2)[1]
    return [line.strip() for line in block.splitlines() if line and not line[0].isspace()]


def test_the_readme_architecture_is_the_layer_contract():
    assert readme_layers() == contract_layers()


def test_every_package_module_is_in_a_layer():
    """A new top-level module of quant must be placed in the contract (and so in the README)."""
    layered = {name.strip() for layer in contract_layers() for name in layer.split("|")}
    modules = {f"quant.{p.stem}" for p in (REPO / "quant").iterdir()
               if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert modules - layered == set(), "add these to the layers contract in pyproject.toml and to README.md"


ENGINE_LAYER = ("quant/engines.py", "quant/engine_rules.py", "quant/engine_files.py")


def _engine_knowledge_in_code(paths: list[Path], exact_engine_names: bool = False) -> list[str]:
    """String constants (docstrings aside; comments are not code), names and attributes that name an engine or a model
    class; with `exact_engine_names`, also any string that is exactly an engine's name in engines/index.yaml (an
    `engine == "transformers"` branch; the preflight may name the transformers package it reads a table of)."""
    import ast
    import re

    import yaml

    pattern = re.compile(r"sglang|vllm|ForCausalLM|ForConditionalGeneration", re.IGNORECASE)
    index = REPO / "quant" / "manifests" / "engines" / "index.yaml"
    engine_names = set(yaml.safe_load(index.read_text())["engines"]) if exact_engine_names else set()
    found = []
    for path in paths:
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        where = path.relative_to(REPO)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                    and (pattern.search(node.value) or node.value.strip().lower() in engine_names):
                found.append(f"{where}:{node.lineno} {node.value[:60]!r}")
            elif isinstance(node, ast.Name) and pattern.search(node.id):
                found.append(f"{where}:{node.lineno} {node.id}")
            elif isinstance(node, ast.Attribute) and pattern.search(node.attr):
                found.append(f"{where}:{node.lineno} .{node.attr}")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and pattern.search(node.name):
                found.append(f"{where}:{node.lineno} def {node.name}")
    return found


def test_no_engine_name_or_architecture_in_the_preflights_code():
    """Engine knowledge is rule data (quant/manifests/engines/): the preflight's code names no engine release
    and no model class (docstrings and comments aside)."""
    # synthetic.py builds full-size header-only checkpoints for the benchmarks and tests: data, not the preflight.
    paths = sorted(p for p in (REPO / "quant" / "verify").glob("*.py") if p.name != "synthetic.py")
    assert _engine_knowledge_in_code(paths) == []


def test_no_engine_name_or_architecture_in_the_engines_layer():
    """The engines layer reads the engine files and answers through the profile (quant.engines.Profile): no rule of one
    engine leaks back into Python (an `if engine == "sglang"` branch, a function named after an engine, a model
    class spelled in code). What differs between engines is a rule key of the engine files, typed in engine_rules.py."""
    assert _engine_knowledge_in_code([REPO / p for p in ENGINE_LAYER], exact_engine_names=True) == []
