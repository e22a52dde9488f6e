"""Lesson 01's accumulation explorer: a slider move answers fast, labels fit, a picture ships.

A test cannot drag a slider, but it can set a control's value, which runs the same callback.
Timings are ratios to a cached move measured in the same process, so a slow or loaded machine
scales both sides; the absolute times are printed (pytest -s) for the record.
"""

import re
import statistics
import time

import matplotlib
import pytest

matplotlib.use("Agg")

from gas_lab.lessons.widgets import accumulation_explorer  # noqa: E402


@pytest.fixture
def explorer(capsys):
    box = accumulation_explorer()
    yield box
    capsys.readouterr()  # the Output widget prints its SVG outside a notebook


def _move(control, value) -> float:
    t0 = time.perf_counter()
    control.value = value
    return time.perf_counter() - t0


def test_only_a_new_spread_computes_anything(explorer):
    n, spread, norm, label, _ = explorer.children
    assert explorer.computed == 1  # the spread it opened with
    n.value, norm.value = 7, "token"
    assert explorer.computed == 1 and "token, N=7" in label.value
    spread.value = 0.8
    assert explorer.computed == 2
    spread.value = 0.5  # seen before: from the cache
    assert explorer.computed == 2 and "spread=0.50" in label.value


def test_a_slider_move_costs_about_a_redraw(explorer):
    """An uncached move (new numbers, then the redraw) against a cached one (the redraw alone).

    Before the cache and the one-thread compute, every move recomputed 24 gradient pairs with
    torch's default threads: 6.5-12.9 s on a loaded 2-core machine, dozens of redraws.
    """
    n, spread, *_ = explorer.children
    cached = [_move(n, v) for v in (2, 3, 5, 6, 4)]
    uncached = [_move(spread, v) for v in (0.1, 0.3, 0.7, 0.9, 1.0)]
    ratio = statistics.median(uncached) / statistics.median(cached)
    print(
        f"\nslider move: cached median {statistics.median(cached) * 1000:.0f} ms, "
        f"new spread median {statistics.median(uncached) * 1000:.0f} ms, ratio {ratio:.1f}"
    )
    assert explorer.computed == 6
    assert ratio < 5, f"a new spread costs {ratio:.1f} cached redraws"


def test_control_descriptions_are_not_cut(explorer):
    """ipywidgets cuts a description at its description_width: each must fit it (<= 0.6 em a
    character, generous for a proportional font)."""
    for control in explorer.children[:3]:
        width = control.style.description_width
        assert width.endswith("em"), f"{control.description!r}: width {width!r}"
        assert len(control.description) * 0.6 <= float(width[:-2]), control.description


def test_the_explorer_carries_a_picture_of_itself(explorer):
    """Where no kernel runs (the docs site), the text/html picture shows what the sliders set."""
    bundle = explorer._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle  # JupyterLab: the live widget
    picture = bundle["text/html"]
    assert explorer.children[3].value in picture and "JupyterLab" in picture
    texts = re.findall(r"<text[^>]*>([^<]*)</text>", picture)
    assert "N (micro-batches per step)" in texts  # text kept as text: sharp and measurable
