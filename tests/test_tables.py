"""gas_lab.lessons.tables: lesson 06's tables show every character as written, and wrap."""

import pytest

from gas_lab.lessons.tables import html_table


def test_values_are_escaped_not_read_as_markup():
    rows = [{"trap": "uneven <n>", "what goes wrong": "weighs 1/(W*N_rank) (or 1/(W*GAS))"}]
    page = html_table(rows)._repr_html_()
    text = page.replace("<wbr>", "")  # break opportunities, not characters
    assert "1/(W*N_rank) (or 1/(W*GAS))" in text and "uneven &lt;n&gt;" in text
    assert page.count("<tr>") == 2 and "<em>" not in page
    assert "white-space: normal" in page  # cells wrap instead of widening the table
    assert "N_<wbr>rank" in page  # an identifier breaks after "_", not inside a word


def test_every_column_of_every_row_is_shown_in_order():
    rows = [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}]
    page = html_table(rows)._repr_html_()
    assert page.index(">a<") < page.index(">b<") < page.index(">1<") < page.index(">y<")
    assert repr(html_table(rows)).splitlines() == ["1 | x", "2 | y"]


def test_an_empty_table_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="at least one row"):
        html_table([])
