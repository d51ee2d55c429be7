"""Tables for terminals and logs: one printer for every table the commands show (verify-manifest's findings, the
eval's comparison and acceptance tables), so none cuts a number or a name at any width.

- On a terminal (rich's detection; `COLUMNS` honoured, as rich reads it): a table when every name-like cell fits
  whole on one line (prose cells wrap at spaces); else, or when stdout is a pipe or a file, one record per line
  (`-` then `column: value; ...`, a prose cell on its own indented line), plain text without colour, whatever its
  length: what a log or `grep` needs.
- A cell is one string; `markup` columns may hold rich markup (a verdict's colour), stripped in the plain form.

Pure layout decisions (`fits`) are separate from printing, so tests can ask them at any width.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # rich is imported when a table is printed, not when the command line starts
    from rich.console import Console

__all__ = ["Column", "fits", "print_table"]

BORDERS_PER_COLUMN = 3  # rich's box: "│ " before each cell and " " after it
MIN_PROSE = 24  # the narrowest a wrapping column may get before records read better


@dataclass(frozen=True)
class Column:
    """A table column: `prose` wraps at spaces (a message, a fix); any other column keeps each line of its cells
    whole (a tensor name, a number, an interval)."""

    name: str
    prose: bool = False
    style: str | None = None


def _longest_line(text: str) -> int:
    return max((len(line) for line in text.splitlines()), default=0)


def fits(columns: list[Column], rows: list[list[str]], width: int) -> bool:
    """Whether a table of these rows fits `width` with every non-prose cell whole and every prose column at least
    MIN_PROSE wide (or as wide as its longest cell, when that is less)."""
    total = 1  # the closing border
    for i, column in enumerate(columns):
        longest = max([_longest_line(column.name)] + [_longest_line(row[i]) for row in rows])
        total += BORDERS_PER_COLUMN + (min(longest, MIN_PROSE) if column.prose else longest)
    return total <= width


def _strip(text: str) -> str:
    from rich.text import Text

    return Text.from_markup(text).plain


def print_table(console: Console, title: str, columns: list[Column], rows: list[list[str]],
                markup: tuple[int, ...] = ()) -> None:
    """Print `rows` under `title` on `console` (a rich Console): a table where it fits whole on a terminal, one
    record per line otherwise. Columns whose index is in `markup` hold rich markup; others are printed as text."""
    from rich.markup import escape
    from rich.table import Table

    def cell(i: int, value: str) -> str:
        return value if i in markup else escape(value)

    if console.is_terminal and fits(columns, [[_strip(c) if i in markup else c for i, c in enumerate(r)]
                                              for r in rows], console.width):
        table = Table(title=escape(title), show_lines=any("\n" in c for r in rows for c in r))
        for column in columns:
            table.add_column(escape(column.name), no_wrap=not column.prose, overflow="fold", style=column.style)
        for row in rows:
            table.add_row(*(cell(i, c) for i, c in enumerate(row)))
        console.print(table)
        return
    out = console.file
    out.write(title + "\n")
    for row in rows:
        values = [_strip(c) if i in markup else c for i, c in enumerate(row)]
        short = [f"{col.name}: {' / '.join(v.splitlines())}" for col, v in zip(columns, values) if not col.prose and v]
        out.write(_fields("- ", short, console.width if console.is_terminal else None) + "\n")
        for col, v in zip(columns, values):
            if col.prose and v:
                line = f"    {col.name}: {' '.join(v.split())}"
                if console.is_terminal:  # wrapped at spaces only: a name or number is never split
                    line = textwrap.fill(line, console.width, subsequent_indent="      ", break_long_words=False,
                                         break_on_hyphens=False)
                out.write(line + "\n")
    out.flush()


def _fields(first: str, fields: list[str], width: int | None) -> str:
    """`fields` joined by "; " after `first`; with a `width` (a terminal), a new indented line starts before a field
    that would cross it, so no field is split (one longer than the width stands alone on its line)."""
    if width is None:
        return first + "; ".join(fields)
    lines, line = [], first
    for i, f in enumerate(fields):
        piece = f + (";" if i < len(fields) - 1 else "")
        if line.strip(" -") and len(line) + 1 + len(piece) > width:
            lines.append(line)
            line = "  " + piece
        else:
            line = line + ("" if line == first else " ") + piece
    lines.append(line)
    return "\n".join(lines)
