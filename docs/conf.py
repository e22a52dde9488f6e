"""Sphinx configuration: the course site, built from the notebooks nbmake already executed."""

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))

project = "gas_lab"
author = "gas_lab maintainers"
copyright = "2026, gas_lab maintainers"

extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
# The notebooks under lessons/ are copies of the ones `make test` executed with nbmake:
# never execute them a second time here.
nb_execution_mode = "off"
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "colon_fence"]
exclude_patterns = ["_build", "**/.ipynb_checkpoints"]
suppress_warnings = ["mystnb.unknown_mime_type"]  # ipywidgets state cannot render statically

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_mock_imports = []

# MathJax from a pip package instead of a CDN, so formulas render in a room without internet.
import jupyter_server_mathjax  # noqa: E402

html_static_path = [str(Path(jupyter_server_mathjax.__file__).parent / "static")]
mathjax_path = "MathJax.js?config=TeX-AMS-MML_HTMLorMML-full"  # MathJax 2, configured as such:
mathjax2_config = {"tex2jax": {"inlineMath": [["\\(", "\\)"]], "displayMath": [["\\[", "\\]"]]}}
myst_update_mathjax = False  # MyST would add a MathJax 3 option that MathJax 2 misreads

html_theme = "sphinx_book_theme"
html_title = "gas_lab: gradient accumulation, one device to ZeRO-1"
html_theme_options = {"show_toc_level": 2}


def _write_rules_table(app):
    """The rejected-combinations page is generated from gas_lab/rules/refusals.py, the one source."""
    from gas_lab.rules import refusals, traps

    out = DOCS / "_generated"
    out.mkdir(exist_ok=True)
    # A narrow table to scan, then each rule's long fields as its own short section: seven
    # columns of sentences do not fit a page.
    rows = refusals.table()
    summary = [{k: row[k] for k in ("rule", "when", "condition")} for row in rows]
    details = [
        f"**`{row['rule']}`**\n\n"
        + "\n".join(f"- **{key}**: {value}" for key, value in row.items() if key not in summary[0])
        for row in rows
    ]
    (out / "rules_table.md").write_text(refusals.table_markdown(summary) + "\n")
    (out / "rules_details.md").write_text("\n\n".join(details) + "\n")
    trap_rows = [
        {"trap": t.name, "when": t.condition, "what goes wrong": t.symptom, "the rule": t.fix}
        for t in traps.TRAPS
    ]
    (out / "traps_table.md").write_text(refusals.table_markdown(trap_rows) + "\n")


def setup(app):
    app.connect("builder-inited", _write_rules_table)
