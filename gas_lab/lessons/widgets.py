"""ipywidgets explorers for the lessons (lesson 01's accumulation explorer).

Each explorer is a thin shell: the numbers come from a plain function defined here, which has
its own test (a test cannot move a slider; nbmake cannot either). The explorer computes each
spread of lengths once and keeps it, so moving a control only redraws. Displayed, it also
carries a static picture of itself (text/html), which is what the docs site and any viewer
without a kernel show; JupyterLab shows the live widget.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

import ipywidgets as w

from gas_lab.accumulate import (
    REDUCTIONS,
    GradDiff,
    accumulate_gradients,
    compare_grads,
    even_sizes,
    full_batch_gradient,
    split_batch,
    token_losses,
)
from gas_lab.lessons.plots import StillPicture, svg
from gas_lab.toys import TinySeqModel, one_thread, sequence_batch, spread_lengths


# ---------------------------------------------------------------- lesson 01: the compute
def error_vs_reference(
    reduction: str,
    n_micro: int,
    spread: float,
    batch_size: int = 24,
    max_len: int = 16,
    seed: int = 0,
) -> GradDiff:
    """Accumulate a padded sequence batch over ``n_micro`` micro-batches; compare to per-token.

    ``spread`` in [0, 1]: 0 = every sequence ``max_len`` tokens long, 1 = the shortest has one
    token. Micro-batch sizes differ by at most one sample (``even_sizes``), so an N that does
    not divide ``batch_size`` also gives a ragged split.
    """
    batch = sequence_batch(spread_lengths(batch_size, max_len, spread), max_len, seed)
    ref = full_batch_gradient(TinySeqModel(seed), batch, token_losses, "token")
    micro = split_batch(batch, even_sizes(batch_size, n_micro))
    got = accumulate_gradients(TinySeqModel(seed), micro, token_losses, reduction)
    return compare_grads(got, ref)


def explorer_errors(
    spread: float, ns: Sequence[int], reductions: Sequence[str] = REDUCTIONS
) -> dict[str, list[float]]:
    """Max relative error against the per-token reference, per reduction, for each N."""
    with one_thread():
        return {
            norm: [error_vs_reference(norm, n, spread).max_rel for n in ns] for norm in reductions
        }


# ---------------------------------------------------------------- lesson 01: the widget
# Wide enough for the longest description ("reduction"): ipywidgets' default cuts it.
_STYLE = {"description_width": "8.5em"}


class AccumulationExplorer(StillPicture, w.VBox):
    """The explorer's box: (N slider, spread slider, reduction menu, label, plot).

    ``errors_for(spread)`` is cached per spread; ``computed`` counts the spreads computed, so
    a test can tell a redraw from a recomputation.
    """

    CONTROLS = "its sliders and menu redraw the plot live"

    def __init__(self, n_max: int = 8):
        self.ns = list(range(1, n_max + 1))
        self._cache: dict[float, dict[str, list[float]]] = {}
        self.computed = 0
        self.n = w.IntSlider(value=4, min=1, max=n_max, description="N", style=_STYLE)
        self.spread = w.FloatSlider(
            value=0.5, min=0.0, max=1.0, step=0.05, description="length spread", style=_STYLE
        )
        self.norm = w.Dropdown(
            options=list(REDUCTIONS),
            value="microbatch-mean",
            description="reduction",
            style=_STYLE,
        )
        self.label, self.out = w.Label(), w.Output()
        self._fig, self._star = None, None
        super().__init__([self.n, self.spread, self.norm, self.label, self.out])
        for control in (self.n, self.spread, self.norm):
            control.observe(self.redraw, names="value")
        self.redraw()

    def errors_for(self, spread: float) -> dict[str, list[float]]:
        key = round(spread, 6)  # slider steps of 0.05 arrive as 0.15000000000000002
        if key not in self._cache:
            self._cache[key] = explorer_errors(key, self.ns)
            self.computed += 1
        return self._cache[key]

    def redraw(self, _change: object = None) -> None:
        """Show the current controls: new numbers only for a new spread, the same figure."""
        errors = self.errors_for(self.spread.value)
        here = errors[self.norm.value][self.n.value - 1]
        self.label.value = (
            f"{self.norm.value}, N={self.n.value}, spread={self.spread.value:.2f}: "
            f"max rel error {here:.2e}"
        )
        self.show(self._draw(errors, here))

    def _draw(self, errors: dict[str, list[float]], here: float) -> str:
        # One figure for the explorer's life: a move updates its lines instead of building a
        # new figure, which costs more than the numbers themselves.
        import matplotlib.pyplot as plt

        from gas_lab.lessons.plots import FLOOR, plot_error_vs_n

        if self._fig is None:
            self._fig = plot_error_vs_n(
                self.ns, errors, highlight=self.norm.value, title="accumulated vs per-token"
            )
            plt.close(self._fig)  # drawn only into SVG: keep pyplot from showing it again
            (self._star,) = self._fig.axes[0].plot([], [], "k*", markersize=14)
            # "1e-05" instead of mathtext's 10^-5: typesetting tick labels was most of a redraw.
            self._fig.axes[0].yaxis.set_major_formatter("{x:.0e}")
        ax = self._fig.axes[0]
        for line in ax.lines:
            name = line.get_label()
            if name in errors:
                line.set_ydata([max(y, FLOOR) for y in errors[name]])
                line.set_alpha(1.0 if name == self.norm.value else 0.3)
                line.set_linewidth(2.5 if name == self.norm.value else 1.0)
        self._star.set_data([self.n.value], [max(here, FLOOR)])
        ax.relim()
        ax.autoscale_view()
        ax.legend()  # anew: a legend copies the line styles it was made with
        return svg(self._fig)

    def still_what(self) -> str:
        return f"explorer ({html.escape(self.label.value)})"


def accumulation_explorer(n_max: int = 8) -> AccumulationExplorer:
    """Sliders for N and length spread, a reduction menu, and a live error plot.

    Returns the widget box; its ``.children`` are (N slider, spread slider, dropdown, label,
    output), so a test can set values and read the label.
    """
    return AccumulationExplorer(n_max)
