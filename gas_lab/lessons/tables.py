"""Tables for the lessons (lesson 06): rows of plain text, shown as an HTML table that wraps.

A markdown table of sentences is too wide for a page, and markdown reads ``W*N`` as italics.
``html_table`` escapes every value and lets each cell wrap, so a table fits its output box in
JupyterLab and on the docs site, and shows every character as written.
"""

from __future__ import annotations

import html
import re
from collections.abc import Mapping, Sequence

# Inline styles: JupyterLab right-aligns table cells and the docs theme has its own table
# CSS; these read the same in both. Long identifiers (managed_gradient_accumulation=False)
# may break after _ . = / , (a <wbr>), never inside a word, so narrow columns stay readable.
_CELL = (
    "text-align: left; vertical-align: top; padding: 0.3em 0.5em; white-space: normal; "
    "overflow-wrap: break-word"
)
_BREAK_AFTER = re.compile(r"([_.=/,])(?=\S)")


def _cell(value: object) -> str:
    return _BREAK_AFTER.sub(r"\1<wbr>", html.escape(str(value), quote=False))


class HTMLTable:
    """A table a notebook displays as HTML (``_repr_html_``) and a test reads as ``rows``."""

    def __init__(self, rows: Sequence[Mapping[str, object]]):
        if not rows:
            raise ValueError("html_table needs at least one row")
        self.rows = [dict(row) for row in rows]
        self.columns = list(self.rows[0])

    def _repr_html_(self) -> str:
        head = "".join(f'<th style="{_CELL}">{_cell(c)}</th>' for c in self.columns)
        body = "".join(
            "<tr>"
            + "".join(f'<td style="{_CELL}">{_cell(row.get(c, ""))}</td>' for c in self.columns)
            + "</tr>"
            for row in self.rows
        )
        return (
            '<table class="gas-lab-table" style="width: 100%; font-size: 0.85em">'
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
        )

    def __repr__(self) -> str:  # where no HTML renders: one line per row
        return "\n".join(" | ".join(str(row.get(c, "")) for c in self.columns) for row in self.rows)


def html_table(rows: Sequence[Mapping[str, object]]) -> HTMLTable:
    """``rows`` (dicts with the same keys) as a table that wraps its text; display it."""
    return HTMLTable(rows)
