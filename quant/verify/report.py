"""Findings, their grouping over layers/experts, and the rich / JSON renderings."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from quant.checkpoint import UNREADABLE_PROBLEMS
from quant.terminal import Column, print_table

SEVERITIES = ("error", "warning")
# The rules of integrity findings whose shard cannot be read (hygiene.integrity_findings).
UNREADABLE_RULES = tuple(f"integrity: {kind}" for kind in UNREADABLE_PROBLEMS)
_LAYER_NUM = re.compile(r"(?<=layers\.)\d+")
_EXPERT_NUM = re.compile(r"(?<=experts\.)\d+")


@dataclass(frozen=True)
class Finding:
    """One predicted problem. `engine` is "sglang", "vllm", "transformers" or "all" (engine-independent);
    `versions` are the engine releases it affects; `tensor` names the tensor (or config key) at fault."""

    severity: str
    engine: str
    versions: tuple[str, ...]
    tensor: str | None
    message: str
    fix: str
    rule: str = ""

    def key(self) -> tuple:
        return (self.severity, self.engine, self.tensor, self.message, self.fix, self.rule)


def normalize(text: str | None) -> str:
    """Layer and expert indices replaced by {L} / {E}, so one mistake repeated over layers groups together."""
    if not text:
        return text or ""
    return _EXPERT_NUM.sub("{E}", _LAYER_NUM.sub("{L}", text))


@dataclass
class Group:
    severity: str
    engine: str
    versions: tuple[str, ...]
    rule: str
    tensor: str
    message: str
    fix: str
    findings: list[Finding] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.findings)

    def shown(self) -> tuple[str, str, str]:
        """(tensor, message, fix): the finding itself when alone, the {L}/{E} pattern for a group."""
        if self.count == 1:
            f = self.findings[0]
            return f.tensor or "", f.message, f.fix
        return self.tensor, self.message, self.fix


def merge_versions(findings: list[Finding], release_order: dict[str, list[str]]) -> list[Finding]:
    """One finding per distinct problem, its `versions` the union over the releases that reported it."""
    merged: dict[tuple, Finding] = {}
    for f in findings:
        k = f.key()
        if k in merged:
            versions = set(merged[k].versions) | set(f.versions)
            order = release_order.get(f.engine, [])
            merged[k] = Finding(f.severity, f.engine, tuple(sorted(versions, key=lambda v: (
                order.index(v) if v in order else len(order), v))), f.tensor, f.message, f.fix, f.rule)
        else:
            merged[k] = f
    return list(merged.values())


def group_findings(findings: list[Finding]) -> list[Group]:
    groups: dict[tuple, Group] = {}
    for f in findings:
        k = (f.severity, f.engine, f.versions, f.rule, normalize(f.tensor), normalize(f.message), normalize(f.fix))
        g = groups.get(k)
        if g is None:
            g = groups[k] = Group(f.severity, f.engine, f.versions, f.rule, k[4], k[5], k[6])
        g.findings.append(f)
    return sorted(groups.values(), key=lambda g: (SEVERITIES.index(g.severity), g.engine, g.rule, g.tensor))


@dataclass
class Report:
    path: str
    profiles: list[str]
    findings: list[Finding]
    source: object | None = None  # quant.verify.source.SourceDescription: not an export, what it is instead

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def exit_code(self) -> int:
        """0: no error; 1: an engine would fail or load wrong weights; 2: a shard cannot be read at all."""
        if any(f.rule in UNREADABLE_RULES for f in self.errors):
            return 2
        return 1 if self.errors else 0

    def groups(self) -> list[Group]:
        return group_findings(self.findings)

    def to_json(self) -> dict:
        return {
            "checkpoint": self.path,
            "profiles": self.profiles,
            "errors": len(self.errors),
            "warnings": len(self.warnings),
            "groups": [
                dict(zip(("tensor", "message", "fix"), g.shown()), severity=g.severity, engine=g.engine,
                     versions=list(g.versions), rule=g.rule, count=g.count)
                for g in self.groups()
            ],
            "findings": [dict(asdict(f), versions=list(f.versions)) for f in self.findings],
            **({"source": self.source.to_json()} if self.source is not None else {}),
        }


def render(report: Report, console) -> None:
    """The report on `console`: a table per severity where it fits a terminal whole, one record per finding group
    otherwise (a pipe, a log, a narrow terminal: quant.terminal)."""
    from rich.markup import escape


    groups = report.groups()
    console.print(escape(f"verify-manifest {report.path}: checked {', '.join(report.profiles)}"), highlight=False)
    if report.source is not None:
        console.print(f"{escape(report.source.what)}.\n{escape(report.source.would)}.", highlight=False)
    columns = [Column("engine"), Column("tensor"), Column("what the engine does", prose=True),
               Column("fix", prose=True)]
    for severity in ("error", "warning"):
        rows = [g for g in groups if g.severity == severity]
        if not rows:
            continue
        cells = []
        for g in rows:
            tensor, message, fix = g.shown()
            cells.append([g.engine + (f"\n{', '.join(g.versions)}" if g.versions else ""),
                          tensor + (f"\n(x{g.count})" if g.count > 1 else ""),
                          message + (f" [{g.rule}]" if g.rule else ""), fix])
        print_table(console, f"{len(rows)} {severity} group(s), {sum(g.count for g in rows)} finding(s)", columns,
                    cells)
    verdict = "[bold red]FAIL[/bold red]" if report.errors else "[bold green]PASS[/bold green]"
    console.print(f"{verdict}: {len(report.errors)} error(s), {len(report.warnings)} warning(s)"
                  + (" (full list: --json)" if any(g.count > 1 for g in groups) else ""), highlight=False)
