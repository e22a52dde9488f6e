"""Sphinx configuration: the course site, built from the notebooks nbmake already executed."""

import re
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
nb_merge_streams = True  # also applies "\r": a text progress bar shows its final state
myst_enable_extensions = ["dollarmath", "colon_fence"]
# _generated/ holds pieces that rules.md includes, not pages of their own (no orphan page in
# the search).
exclude_patterns = ["_build", "**/.ipynb_checkpoints", "_generated"]
# `display(Markdown(...))` outputs are parsed like the pages, so a markdown table is a table.
nb_render_markdown_format = "myst"
# Widgets need a live kernel; the site has none. It neither loads the widget renderer (from a
# CDN, which a room without internet cannot reach) nor shows an empty widget view: a widget
# that matters carries a static HTML picture of itself (see gas_lab/lessons/widgets.py).
nb_ipywidgets_js = {}
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None)]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_mock_imports = []
# A method without a docstring (a model's forward) must not borrow torch's ("Should be
# overridden by all subclasses"), which tells a learner nothing about gas_lab.
autodoc_inherit_docstrings = False

# MathJax from a pip package instead of a CDN, so formulas render in a room without internet.
import jupyter_server_mathjax  # noqa: E402

templates_path = ["_templates"]
html_static_path = ["_static", str(Path(jupyter_server_mathjax.__file__).parent / "static")]
html_css_files = ["gas_lab.css"]
html_favicon = "_static/favicon.svg"
mathjax_path = "MathJax.js?config=TeX-AMS-MML_HTMLorMML-full"  # MathJax 2, configured as such:
mathjax2_config = {
    "tex2jax": {"inlineMath": [["\\(", "\\)"]], "displayMath": [["\\[", "\\]"]]},
    # The package ships MathJax's STIX-Web fonts only (not its TeX fonts): use them, and never
    # fall back to local or image fonts, which misplace underbraces, fractions and roots.
    "HTML-CSS": {
        "availableFonts": [],
        "preferredFont": None,
        "webFont": "STIX-Web",
        "imageFont": None,
        "linebreaks": {"automatic": True},  # a long displayed equation breaks on a phone
        # MathJax measures text in a never-loading reference font; its default source,
        # about:blank, is a CORS error in every browser console. A local() name never loads
        # either, silently.
        "styles": {"@font-face": {"font-family": "MathJax_Blank", "src": "local('MathJax_Blank')"}},
    },
}
myst_update_mathjax = False  # MyST would add a MathJax 3 option that MathJax 2 misreads

# Text as written: no curly quotes in {"enabled": false} or in a DeepSpeed message.
smartquotes = False

html_theme = "sphinx_book_theme"
html_title = "gas_lab: gradient accumulation, one device to ZeRO-1"
html_theme_options = {"show_toc_level": 2}
# The color mode a first visit starts in (before the reader picks one). The theme's page script
# reads it from the page, where it is empty unless set here, and a first visit then logged
# "Got invalid theme mode" as a console error.
html_context = {"default_mode": "auto"}

# Theme files no page loads (templates/layout.html leaves out fontawesome.js: the theme's CSS
# draws the same icons from a web font), removed from the built site.
UNUSED_THEME_FILES = ["scripts/fontawesome.js*", "scripts/*.map"]


def _markdown_text(value) -> str:
    """Plain text as markdown that shows it as written: ``W*N`` stays a product, not italics."""
    return re.sub(r"([\\`*_\[\]<>$#])", r"\\\1", str(value)).replace("\n", " ")


def _write_rules_table(app):
    """The rejected-combinations page, generated from the rules (gas_lab/rules/*_refusals.py,
    gathered by refusals.py), the one source."""
    from gas_lab.rules import refusals, traps

    out = DOCS / "_generated"
    out.mkdir(exist_ok=True)
    # A narrow table to scan, then each rule's long fields as its own short section: seven
    # columns of sentences do not fit a page. Every value is plain text (escaped).
    rows = refusals.table()
    summary = [{k: _markdown_text(row[k]) for k in ("rule", "when", "condition")} for row in rows]
    details = [
        f"**`{row['rule']}`**\n\n"
        + "\n".join(
            f"- **{key}**: {_markdown_text(value)}"
            for key, value in row.items()
            if key not in summary[0]
        )
        for row in rows
    ]
    (out / "rules_table.md").write_text(refusals.table_markdown(summary) + "\n")
    (out / "rules_details.md").write_text("\n\n".join(details) + "\n")
    trap_rows = [
        {
            k: _markdown_text(v)
            for k, v in {
                "trap": t.name,
                "when": t.condition,
                "what goes wrong": t.symptom,
                "the rule": t.fix,
            }.items()
        }
        for t in traps.TRAPS
    ]
    (out / "traps_table.md").write_text(refusals.table_markdown(trap_rows) + "\n")


def _remove_unused_theme_files(app, exception):
    if exception is None and app.builder.format == "html":
        static = Path(app.outdir) / "_static"
        for pattern in UNUSED_THEME_FILES:
            for path in static.glob(pattern):
                path.unlink()


def setup(app):
    app.connect("builder-inited", _write_rules_table)
    app.connect("build-finished", _remove_unused_theme_files)
