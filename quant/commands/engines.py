"""`quant engines show ARCH`: what each profiled engine release's merged rules say for one architecture."""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from quant.errors import QuantError, did_you_mean
from quant.families import all_families

app = typer.Typer(help="The engine profiles (quant/manifests/engines/): one file per engine release.",
                  no_args_is_help=True)


@app.command("show")
def show(
    arch: str = typer.Argument(..., help="The model class, as config.json's architectures[0] names it "
                                         "(DeepseekV3ForCausalLM)."),
    engine: Optional[List[str]] = typer.Option(None, "--engine", "-e",
                                               help="sglang | vllm | transformers | all, or one release: "
                                                    "sglang==0.5.23 (repeatable; default: every profiled release)."),
    json_out: bool = typer.Option(False, "--json", help="Print the rules as JSON, keyed by release."),
) -> None:
    """Print the merged rules (engine-wide, then the release's own) of each engine release for one architecture:
    the rules keyed by architecture reduced to its entry, every other rule as the release states it."""
    import yaml

    from quant.engine_rules import for_architecture

    profiles = _releases(engine)
    _check_architecture(arch)
    views = {p.label: {"title": p.title, "rules": for_architecture(p.rules, arch)} for p in profiles}
    if json_out:
        typer.echo(json.dumps({"architecture": arch, "releases": views}, indent=1))
        return
    for label, view in views.items():
        typer.echo(f"# {label} ({view['title']}), {arch}")
        # lists of plain values on one line (default_flow_style=None), mappings as blocks
        typer.echo(yaml.safe_dump(view["rules"], sort_keys=False, width=120, allow_unicode=True,
                                  default_flow_style=None))


def _releases(specs: Optional[List[str]]) -> list:
    """The releases `--engine` names: ENGINE==RELEASE one, an engine name (or all) every release of it, not only
    its default ones; none: every profiled release."""
    from quant.engines import all_profiles, select_profiles

    out: list = []
    for item in [i.strip() for spec in specs or ["all"] for i in str(spec).split(",") if i.strip()]:
        if "==" in item:
            named = select_profiles([item])
        else:
            select_profiles([item])  # an unknown engine: its one-line error
            named = [p for p in all_profiles() if item == "all" or p.engine == item]
        out += [p for p in named if p not in out]
    return out


def _check_architecture(arch: str) -> None:
    """An architecture no family is released with and no rule names is a typo: one line with the closest."""
    from quant.engine_rules import architectures_named
    from quant.engines import all_profiles

    known = {a for f in all_families() for a in f.architecture_classes()}
    known |= {a for p in all_profiles() for a in architectures_named(p.rules)}
    if arch not in known:
        raise QuantError(f"unknown architecture '{arch}'{did_you_mean(arch, sorted(known))} (known: the families' "
                         f"architectures and those the engine rules name)")
