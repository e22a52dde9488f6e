"""The runtime's notices: what it did for the learner (ranks restarted, a one-time build, another
notebook's ranks), told apart from its errors at a glance.

An error ends the cell (an exception, shown by Jupyter in red with the rank's traceback). A
notice does not: in a notebook it is a display of its own, a line marked "gas_lab notice:" on a
blue rule, never the red of stderr, which JupyterLab gives to anything written there. Outside a
notebook (a script, a test) it is the same line on stderr, where a script's own output is not.
"""

from __future__ import annotations

import html
import sys

from gas_lab.runtime.streaming import in_notebook

PREFIX = "gas_lab notice: "
_STYLE = "border-left: 3px solid #1f6feb; padding: 1px 8px; margin: 2px 0; font-family: monospace"


def _bundle(text: str) -> dict:
    return {
        "text/plain": PREFIX + text,
        "text/html": f'<div style="{_STYLE}">&#9432; {html.escape(PREFIX + text)}</div>',
    }


class Notice:
    """One notice line; :meth:`update` rewrites it in place in a notebook (a live elapsed time),
    while outside one only the first and the :meth:`update` with ``final=True`` are printed."""

    def __init__(self, text: str):
        self.live = in_notebook()
        self.handle = None
        if self.live:
            from IPython.display import display

            sys.stdout.flush()
            sys.stderr.flush()  # below what was printed before it
            self.handle = display(_bundle(text), raw=True, display_id=True)
        else:
            print(PREFIX + text, file=sys.stderr, flush=True)

    def update(self, text: str, final: bool = False) -> None:
        if self.handle is not None:
            self.handle.update(_bundle(text), raw=True)
        elif final:
            print(PREFIX + text, file=sys.stderr, flush=True)


def notice(text: str) -> Notice:
    """Tell the learner what the runtime did (see the module docstring)."""
    return Notice(text)
