"""The timeline explorer (lesson 04): library, mode, stage and N per rank as controls, and the
timeline they give (:func:`gas_lab.lessons.timeline_plots.plot_timeline`), recorded on the
notebook's ranks. Without ipywidgets it is one static figure."""

from __future__ import annotations

import html

import matplotlib.pyplot as plt

from gas_lab.lessons.plots import StillPicture, svg
from gas_lab.lessons.timeline_plots import LIBRARY_TITLES, plot_timeline
from gas_lab.measure.recording import PlanError, check_plan, record_on

try:
    import ipywidgets as w
except ImportError:  # the explorer falls back to one static figure
    w = None


def timeline_explorer(cluster, n_max: int = 4, **start):
    """Library, mode, stage and N per rank as controls, and the timeline they give, recorded on
    ``cluster``'s ranks (each setting once, then kept). ``start``: the first setting (library,
    stage, mode, micro_batches). Without ipywidgets: that setting's static figure."""
    if w is None:
        return plot_timeline(record_on(cluster, **{**EXPLORER_START, **start}))
    return TimelineExplorer(cluster, n_max, **start)


EXPLORER_START = {"library": "gas_lab", "stage": 0, "mode": "unmanaged", "micro_batches": [3, 1]}


class TimelineExplorer(StillPicture, w.VBox if w is not None else object):
    """The explorer's box: (library, mode, stage, one N slider per rank, message, figure).

    ``recorded`` holds the events of every setting run so far, so a test can tell a redraw
    from a new recording.
    """

    CONTROLS = "its buttons and sliders record and redraw it"

    def __init__(self, cluster, n_max: int = 4, **start):
        start = {**EXPLORER_START, **start}
        self.cluster, self.recorded = cluster, {}
        counts = list(start["micro_batches"])
        counts = counts * cluster.world_size if len(counts) == 1 else counts
        style = {"description_width": "7em"}

        def buttons(name, options):
            return w.ToggleButtons(
                options=options, value=start[name], style=style, description=name.replace("_", " ")
            )

        self.library = buttons("library", list(LIBRARY_TITLES))
        self.mode = buttons("mode", ["managed", "unmanaged"])
        self.stage = buttons("stage", [0, 1, 2])
        self.ns = [
            w.IntSlider(value=n, min=1, max=n_max, description=f"N on rank {r}", style=style)
            for r, n in enumerate(counts)
        ]
        self.message, self.out = w.HTML(), w.Output()
        controls = [self.library, self.mode, self.stage, *self.ns]
        super().__init__([*controls, self.message, self.out])
        for control in controls:
            control.observe(self.redraw, names="value")
        self.redraw()

    def settings(self) -> dict:
        return {
            "library": self.library.value,
            "stage": self.stage.value,
            "mode": self.mode.value,
            "micro_batches": [s.value for s in self.ns],
        }

    def redraw(self, _change: object = None) -> None:
        """Record the setting if new (a DeepSpeed start costs about a second), then draw it;
        a setting that cannot run says why and clears the picture, which showed another setting."""
        s = self.settings()
        try:
            check_plan(s["library"], s["stage"], s["mode"], s["micro_batches"], 1, len(self.ns))
        except PlanError as e:
            self.message.value = f"<b>Not run:</b> {html.escape(e.reason)}"
            self._svg = ""
            self.out.clear_output()
            return
        key = repr(sorted(s.items()))
        if key not in self.recorded:
            self.recorded[key] = record_on(self.cluster, **s)
        ns = ", ".join(map(str, s["micro_batches"]))
        self.message.value = html.escape(
            f"{LIBRARY_TITLES[s['library']]}, stage {s['stage']}, {s['mode']}, N = {ns}"
        )
        fig = plot_timeline(self.recorded[key])
        plt.close(fig)  # drawn only into SVG: keep pyplot from showing it again
        self.show(svg(fig))

    def still_what(self) -> str:
        return f"timeline explorer ({self.message.value})"
