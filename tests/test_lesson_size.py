"""Each notebook fits the minutes it states (issue 20).

- at most 45 cells in any notebook, lesson or appendix;
- at most 2,500 words of prose in a core lesson (00-09);
- the minutes a notebook states, ``(≈ N minutes)``, hold within 20% of the minutes a timed
  run-through by someone new measured (``data/run_through.json``: reading estimate from
  tools/lesson_size.py + machine time + one exercise + a minute per cell not understood);
- and that record covers every notebook as it is now: its cells and words are those the
  run-through read, within a small edit (so a notebook that grew must be timed again).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from lesson_size import STATED_MINUTES, size  # noqa: E402

NOTEBOOKS = sorted(
    p
    for pattern in ("[0-9][0-9]_*.ipynb", "A[0-9]_*.ipynb")
    for p in (ROOT / "tutorials").glob(pattern)
)
RUN_THROUGH = json.loads((ROOT / "data" / "run_through.json").read_text())
MAX_CELLS, MAX_WORDS, TOLERANCE = 45, 2500, 0.20
# A re-timed notebook may drift this much before it must be timed again.
DRIFT_CELLS, DRIFT_WORDS = 3, 150


def _stated_minutes(path: Path) -> int:
    first = "".join(json.loads(path.read_text())["cells"][0]["source"])
    found = STATED_MINUTES.search(first)
    assert found, f"{path.name}: the first cell states no '(≈ N minutes)'"
    return int(found["total"])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_notebook_fits_its_limits(path):
    s = size(path)
    assert s.cells <= MAX_CELLS, f"{path.name}: {s.cells} cells (at most {MAX_CELLS})"
    if path.name[0].isdigit():
        assert s.words <= MAX_WORDS, f"{path.name}: {s.words} words of prose (at most {MAX_WORDS})"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_the_stated_minutes_are_the_measured_ones(path):
    record = RUN_THROUGH["notebooks"].get(path.name)
    assert record, f"{path.name} was never timed: add a run-through to data/run_through.json"
    stated, measured = _stated_minutes(path), record["total_minutes"]
    assert abs(stated - measured) <= TOLERANCE * measured, (
        f"{path.name} states {stated} minutes; a run-through took {measured}"
    )
    s = size(path)
    assert abs(s.cells - record["cells"]) <= DRIFT_CELLS, (
        f"{path.name} has {s.cells} cells, the run-through read {record['cells']}: time it again"
    )
    assert abs(s.words - record["words"]) <= DRIFT_WORDS, (
        f"{path.name} has {s.words} words, the run-through read {record['words']}: time it again"
    )


def test_the_record_names_no_notebook_that_is_gone():
    names = {p.name for p in NOTEBOOKS}
    assert set(RUN_THROUGH["notebooks"]) <= names


def test_the_readme_states_the_same_minutes():
    """The README's lesson table (a row per notebook, core and appendix) says what each notebook
    states at its top."""
    readme = (ROOT / "README.md").read_text()
    rows = dict(
        re.findall(r"^\| (?:\d\d|A\d) \| `([^`]+\.ipynb)` \|[^|]*\| (\d+) \|", readme, re.M)
    )
    assert set(rows) == {p.name for p in NOTEBOOKS}, "the README's table lists every notebook"
    for path in NOTEBOOKS:
        assert int(rows[path.name]) == _stated_minutes(path), f"README row of {path.name}"


def test_the_record_points_to_its_method_and_the_method_is_written_down():
    """The record's ``method`` names the page that says how to time a notebook again."""
    page, section = re.search(r"\((docs/[^,]+\.md), \"([^\"]+)\"\)", RUN_THROUGH["method"]).groups()
    assert f"## {section}\n" in (ROOT / page).read_text(), f"{page} has no section {section!r}"
