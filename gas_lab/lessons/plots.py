"""Matplotlib figures for the lessons.

Every function takes plain numbers (lists, dicts of lists), draws on ``ax`` if given or on a
new figure, and returns the figure, so a notebook cell shows it and a test can inspect it.
Errors go on a log axis; an exact zero is drawn at ``floor`` so it stays visible. Text uses the
rc sizes, never smaller ones: tutorials/matplotlibrc sets them so that a figure stays readable
on a projector and on the docs site (tests/test_docs_site.py measures it).
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

#: Where an exact zero is drawn on a log axis.
FLOOR = 1e-9

#: One colour per reduction (and the forgotten / N), so every lesson draws them the same way.
COLOURS = {
    "microbatch-mean": "crimson",
    "sequence": "darkorange",
    "token": "seagreen",
    "microbatch-mean-sum": "purple",
}


def _axes(ax: Axes | None, figsize: tuple[float, float] = (6.0, 3.5)) -> tuple[Figure, Axes]:
    if ax is not None:
        return ax.figure, ax
    fig, ax = plt.subplots(figsize=figsize)
    return fig, ax


def plot_errors(
    xs: Sequence[float],
    errors: Mapping[str, Sequence[float]],
    xlabel: str,
    *,
    ylabel: str = "max rel. error vs reference",
    ax: Axes | None = None,
    title: str | None = None,
    highlight: str | None = None,
    floor: float = FLOOR,
) -> Figure:
    """One line per series of errors against ``xs``, on a log y axis.

    ``highlight`` draws that series thick and the others faint (the explorer uses this).
    """
    fig, ax = _axes(ax)
    for name, ys in errors.items():
        faint = highlight is not None and name != highlight
        ax.plot(
            xs,
            [max(y, floor) for y in ys],
            marker="o",
            label=name,
            color=COLOURS.get(name),
            alpha=0.3 if faint else 1.0,
            linewidth=1.0 if faint else 2.5 if highlight else 1.5,
        )
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.axhline(1e-5, color="grey", linestyle=":", linewidth=1, label="float32 noise below")
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig


def plot_error_vs_n(
    ns: Sequence[int], errors: Mapping[str, Sequence[float]], **kwargs: object
) -> Figure:
    """Error of each reduction against the reference, as the number N of micro-batches grows."""
    return plot_errors(ns, errors, "N (micro-batches per step)", **kwargs)  # type: ignore[arg-type]


def plot_loss_curves(
    curves: Mapping[str, Sequence[float]],
    *,
    ax: Axes | None = None,
    title: str | None = None,
    logy: bool = True,
) -> Figure:
    """Training loss per optimizer step, one line per run."""
    fig, ax = _axes(ax)
    for name, losses in curves.items():
        ax.plot(range(len(losses)), losses, label=name)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("full-batch loss")
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig


def plot_shards(numels: Sequence[int], names: Sequence[str], worlds: Sequence[int]) -> Figure:
    """ZeRO's flat vector (lesson 05): the tensors laid end to end, the zero padding, and the
    shard each rank owns, one row per world size in ``worlds``
    (:class:`gas_lab.zero1.Layout` computes where everything sits)."""
    from gas_lab.zero1 import Layout

    height = 0.9 + 1.2 * len(worlds)
    fig, axes = plt.subplots(len(worlds), 1, figsize=(8, height), sharex=True)
    axes = [axes] if len(worlds) == 1 else list(axes)
    colours = plt.cm.tab10.colors
    for ax, world in zip(axes, worlds, strict=True):
        layout = Layout.of(numels, world)
        for i, (offset, n) in enumerate(zip(layout.offsets, numels, strict=True)):
            ax.barh(0, n, left=offset, color=colours[i % 10], edgecolor="white", label=names[i])
        ax.barh(
            0, layout.padding, left=layout.numel, color="lightgrey", hatch="//", label="padding"
        )
        for rank in range(world):
            start, end = layout.shard(rank)
            ax.axvline(start, color="black", lw=2)
            ax.text((start + end) / 2, 0.55, f"rank {rank}", ha="center")
        ax.axvline(layout.padded_numel, color="black", lw=2)
        ax.set(yticks=[], ylim=(-0.5, 0.8))
        ax.set_title(f"W = {world}: {world} shards of {layout.shard_size}")
    axes[-1].set_xlabel("position in the flat vector (elements)")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=5)
    fig.tight_layout(rect=(0, 0.4 / height, 1, 1))  # room for the legend
    return fig


def plot_outcomes(
    outcomes: Mapping[str, tuple[float, float]],
    *,
    title: str | None = None,
    noise: float = 1e-6,
    floor: float = FLOOR,
) -> Figure:
    """Lesson 06: for each experiment ``name -> (error, spread)``, how far from the right
    weights and how far apart the ranks ended, as horizontal bars on a log axis (first on top);
    a dashed line at ``noise`` (float32 rounding)."""
    names = list(outcomes)
    fig, ax = _axes(None, figsize=(8.0, 1.2 + 0.4 * len(names)))
    pos = list(range(len(names)))
    errors, spreads = ([max(outcomes[n][i], floor) for n in names] for i in (0, 1))
    ax.barh([p - 0.2 for p in pos], errors, 0.4, label="from the right weights")
    ax.barh([p + 0.2 for p in pos], spreads, 0.4, label="ranks apart")
    ax.set_yticks(pos, names)
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.axvline(noise, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel(
        f"max |difference| in any weight (log; float32 noise < 1e{math.log10(noise):.0f})"
    )
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig


def svg(fig: Figure) -> str:
    """The figure as SVG text, text kept as text (sharp, searchable, measurable)."""
    buffer = io.StringIO()
    with plt.rc_context({"svg.fonttype": "none"}):
        fig.savefig(buffer, format="svg")
    out = buffer.getvalue()
    return out[out.index("<svg") :]


class StillPicture:
    """What an explorer widget (an ipywidgets box with an ``out`` Output) needs to show one SVG
    figure: :meth:`show` draws it live, and displaying the box also carries a still picture of
    it, for the docs site and any viewer without a kernel (which show the HTML and ignore the
    widget). A subclass says what it is (:meth:`still_what`) and what its ``CONTROLS`` do."""

    CONTROLS: str  # "its sliders redraw it": the still picture's caption says so
    _svg = ""  # the picture shown now ("": none)

    def still_what(self) -> str:  # "explorer (N=4)": what the still picture shows
        raise NotImplementedError

    def show(self, picture: str) -> None:
        from IPython.display import display

        self._svg = picture
        with self.out:
            self.out.clear_output(wait=True)
            display({"image/svg+xml": picture}, raw=True)  # IPython's SVG() re-parses it

    def _repr_mimebundle_(self, **kwargs) -> dict:
        bundle = super()._repr_mimebundle_(**kwargs)
        bundle["text/html"] = (
            '<div class="gas-lab-explorer-snapshot">'
            f"<p><em>A still picture of the {self.still_what()}. In JupyterLab "
            f"{self.CONTROLS}.</em></p>{self._svg}</div>"
        )
        return bundle
