"""How big each notebook is, and what reading it costs: the numbers a timed run-through starts from.

    python tools/lesson_size.py [--executed DIR] [NOTEBOOK ...]   # default: tutorials/*.ipynb

Per notebook: cells, words of prose (markdown), code lines (non-blank, non-comment), and the
reading estimate of the issue-20 run-through method: prose at 200 words a minute, code a
learner must understand at 15 lines a minute, assert- and print-only lines at 40 a minute.
With ``--executed DIR`` (executed copies, e.g. build/notebooks) it also counts what the cells
print: library source shown with ``inspect.getsource`` is code to understand, any other printed
line (tables, results) is read at the quick rate. A run-through by someone new adds what only a
reader can tell (the machine time, one exercise, a minute per cell not understood);
``data/run_through.json`` keeps those results and ``tests/test_lesson_size.py`` holds the
stated minutes to them.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The minutes a notebook states in its first cell, "(≈ 25 minutes)".
STATED_MINUTES = re.compile(r"≈\s*(?P<total>\d+)\s*minutes")
WORDS_PER_MINUTE, LINES_PER_MINUTE, CHECK_LINES_PER_MINUTE = 200, 15, 40


@dataclass
class Size:
    name: str
    cells: int
    words: int  # markdown prose
    code_lines: int  # non-blank, non-comment lines of code cells
    check_lines: int  # of those: lines of assert and print statements (read quickly)
    source_lines: int = 0  # printed library source (executed copy only)
    output_lines: int = 0  # other printed lines: tables, results (executed copy only)

    @property
    def reading_minutes(self) -> float:
        understand = self.code_lines - self.check_lines + self.source_lines
        return (
            self.words / WORDS_PER_MINUTE
            + understand / LINES_PER_MINUTE
            + (self.check_lines + self.output_lines) / CHECK_LINES_PER_MINUTE
        )


def _check_lines(source: str) -> int:
    """Lines belonging to top-level ``assert`` and ``print(...)`` statements."""
    try:
        tree = ast.parse("\n".join(line for line in source.splitlines() if not _magic(line)))
    except SyntaxError:
        return 0
    lines: set[int] = set()
    for node in ast.walk(tree):
        is_print = (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and node.value.func.id == "print"
        )
        if isinstance(node, ast.Assert) or is_print:
            lines.update(range(node.lineno, node.end_lineno + 1))
    body = [i + 1 for i, line in enumerate(source.splitlines()) if _counted(line)]
    return len(lines.intersection(body))


def _magic(line: str) -> bool:
    return line.lstrip().startswith(("%", "!"))


def _counted(line: str) -> bool:
    stripped = line.strip()
    return bool(stripped) and not stripped.startswith("#")


def _printed(cell: dict) -> int:
    """Non-blank lines a code cell printed (streams and plain-text results)."""
    text = ""
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            text += "".join(out["text"])
        elif "text/plain" in out.get("data", {}) and "image/svg+xml" not in out["data"]:
            text += "".join(out["data"]["text/plain"])
    return sum(bool(line.strip()) for line in text.splitlines())


def size(path: Path, executed: Path | None = None) -> Size:
    cells = json.loads(path.read_text())["cells"]
    ran = None
    if executed is not None and (executed / path.name).exists():
        ran = json.loads((executed / path.name).read_text())["cells"]
    words = code = checks = source_lines = output_lines = 0
    for i, cell in enumerate(cells):
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            words += len(re.findall(r"\S+", source))
        elif cell["cell_type"] == "code":
            code += sum(_counted(line) for line in source.splitlines())
            checks += _check_lines(source)
            if ran is not None and i < len(ran):
                printed = _printed(ran[i])
                if "getsource" in source:
                    source_lines += printed
                else:
                    output_lines += printed
    return Size(path.name, len(cells), words, code, checks, source_lines, output_lines)


def main(argv: list[str]) -> None:
    executed = None
    if argv[:1] == ["--executed"]:
        executed, argv = Path(argv[1]), argv[2:]
    paths = [Path(a) for a in argv] or sorted((ROOT / "tutorials").glob("*.ipynb"))
    print(
        f"{'notebook':36s} {'cells':>5s} {'words':>6s} {'code':>5s} {'check':>5s} "
        f"{'source':>6s} {'output':>6s} {'read min':>8s}"
    )
    for path in paths:
        s = size(path, executed)
        print(
            f"{s.name:36s} {s.cells:5d} {s.words:6d} {s.code_lines:5d} {s.check_lines:5d} "
            f"{s.source_lines:6d} {s.output_lines:6d} {s.reading_minutes:8.1f}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
