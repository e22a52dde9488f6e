"""ipywidgets explorers for the lessons.

Each explorer is a thin shell: the numbers come from a plain function defined here, which has
its own test (a test cannot move a slider; nbmake cannot either).
"""

from __future__ import annotations

from collections.abc import Sequence

from gas_lab.accumulate import (
    NORMALIZATIONS,
    GradDiff,
    accumulate_gradients,
    compare_grads,
    even_sizes,
    full_batch_gradient,
    split_batch,
    token_loss,
)
from gas_lab.lessons.toys import TinySeqModel, sequence_batch, spread_lengths


# ---------------------------------------------------------------- lesson 01: the compute
def error_vs_reference(
    normalization: str,
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
    ref = full_batch_gradient(TinySeqModel(seed), batch, token_loss, "per_token")
    micro = split_batch(batch, even_sizes(batch_size, n_micro))
    got = accumulate_gradients(TinySeqModel(seed), micro, token_loss, normalization)
    return compare_grads(got, ref)


def explorer_errors(
    spread: float, ns: Sequence[int], normalizations: Sequence[str] = NORMALIZATIONS
) -> dict[str, list[float]]:
    """Max relative error against the per-token reference, per normalization, for each N."""
    return {
        norm: [error_vs_reference(norm, n, spread).max_rel for n in ns] for norm in normalizations
    }


# ---------------------------------------------------------------- lesson 01: the widget
def accumulation_explorer(n_max: int = 8):
    """Sliders for N and length spread, a normalization menu, and a live error plot.

    Returns the widget box; its ``.children`` are (N slider, spread slider, dropdown, label,
    output), so a test can set values and read the label.
    """
    import ipywidgets as w  # imported here so the library works without a notebook stack
    import matplotlib.pyplot as plt
    from IPython.display import display

    from gas_lab.lessons.plots import plot_error_vs_n

    n = w.IntSlider(value=4, min=1, max=n_max, description="N")
    spread = w.FloatSlider(value=0.5, min=0.0, max=1.0, step=0.05, description="length spread")
    norm = w.Dropdown(
        options=list(NORMALIZATIONS), value="mean_of_means", description="normalization"
    )
    label, out = w.Label(), w.Output()

    def redraw(_change: object = None) -> None:
        ns = list(range(1, n_max + 1))
        errors = explorer_errors(spread.value, ns)
        here = errors[norm.value][n.value - 1]
        label.value = (
            f"{norm.value}, N={n.value}, spread={spread.value:.2f}: max rel error {here:.2e}"
        )
        with out:
            out.clear_output(wait=True)
            fig = plot_error_vs_n(
                ns,
                errors,
                highlight=norm.value,
                title="accumulated vs full-batch per-token gradient",
            )
            fig.axes[0].plot([n.value], [max(here, 1e-9)], "k*", markersize=14)
            display(fig)
            plt.close(fig)  # displayed once; closing keeps pyplot from piling up figures

    for control in (n, spread, norm):
        control.observe(redraw, names="value")
    redraw()
    return w.VBox([n, spread, norm, label, out])
