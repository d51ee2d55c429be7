"""README.md renders as written: a CommonMark renderer (markdown-it-py, what rich and most hosts use) must see
every heading as a heading and every pipe table as a table. A closing code fence with text after it
("``` `make test-wheel` ...") is no closing fence in CommonMark: the block runs on and swallows the headings and
tables below it, which a plain-text read of the file does not show."""

from __future__ import annotations

import re
from pathlib import Path

from markdown_it import MarkdownIt

README = Path(__file__).resolve().parent.parent / "README.md"
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_HEADING = re.compile(r"^#{1,6}(\s|$)")
_TABLE_SEPARATOR = re.compile(r"^\|\s*:?-{3,}")


def _written_structure(lines: list[str]) -> tuple[list[int], list[int]]:
    """Line indices of the headings and pipe tables the author wrote, outside the fenced blocks the author meant
    (a line opening with a fence marker toggles a block, whatever follows the marker)."""
    headings, tables, fence = [], [], None
    for i, line in enumerate(lines):
        m = _FENCE.match(line)
        if m:
            marker = m.group(1)
            if fence is None:
                fence = marker
            elif marker[0] == fence[0] and len(marker) >= len(fence):
                fence = None
            continue
        if fence is not None:
            continue
        if _HEADING.match(line):
            headings.append(i)
        elif line.startswith("|") and i + 1 < len(lines) and _TABLE_SEPARATOR.match(lines[i + 1]):
            tables.append(i)
    return headings, tables


def render_problems(text: str) -> list[str]:
    """What a CommonMark renderer shows differently from what `text` was written as (empty when none)."""
    lines = text.splitlines()
    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    heading_lines = {t.map[0] for t in tokens if t.type == "heading_open"}
    table_lines = {t.map[0] for t in tokens if t.type == "table_open"}
    problems = []
    for t in tokens:
        if t.type == "fence" and t.map:
            last = lines[t.map[1] - 1].strip() if t.map[1] - 1 < len(lines) else ""
            closed = t.map[1] - t.map[0] >= 2 and set(last) == {t.markup[0]} and len(last) >= len(t.markup)
            if not closed:
                problems.append(f"line {t.map[0] + 1}: the code fence opened here is never closed")
    headings, tables = _written_structure(lines)
    for i in headings:
        if i not in heading_lines:
            problems.append(f"line {i + 1}: {lines[i]!r} does not render as a heading")
    for i in tables:
        if i not in table_lines:
            problems.append(f"line {i + 1}: the table starting {lines[i][:40]!r} does not render as a table")
    return problems


def test_readme_renders_as_written():
    assert render_problems(README.read_text()) == []


def test_the_check_sees_a_fence_closed_with_text_after_it():
    broken = "# A\n\n```bash\nrun\n``` then prose\n\n## B\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    problems = render_problems(broken)
    assert any("'## B' does not render as a heading" in p for p in problems)
    assert any("does not render as a table" in p for p in problems)
    assert any("never closed" in p for p in problems)
    fixed = broken.replace("``` then prose", "```\nthen prose")
    assert render_problems(fixed) == []
