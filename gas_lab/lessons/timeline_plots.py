"""Timeline figures: one row per rank, the engine's calls as bars, the collectives under them.

Drawn from :mod:`gas_lab.measure.recording`'s events (or a trace file the command wrote)::

    events = recording.record_on(cluster, library="gas_lab", stage=0, mode="unmanaged",
                                 micro_batches=[3, 1])
    plot_timeline(events)                                    # one library
    plot_side_by_side({"gas_lab": ours, "deepspeed": theirs})  # the same sequence, twice

Two time axes. ``time="logical"`` (the default) lays the calls out in their measured order with
fixed widths (a backward wider than a forward, a step that only counts narrow), and lines up
every collective across ranks, because a collective ends on all ranks together: a rank that
arrives first *waits* (hatched) until the last one arrives. That is what these lessons ask
(*when*: inside which call, while the other rank does what), and it draws the same on every
machine. ``time="real"`` draws the measured milliseconds; on a shared 2-core CPU they are
mostly Python overhead and noise, so use it to check a claim about duration, not order.

Labels: ``F0``/``B0`` = forward/backward of micro-batch 0; a collective shows its kind and bytes
where they fit (its colour gives the kind everywhere); dashed lines mark the end of each
optimizer step on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from gas_lab.measure.recording import Event, collectives, ranks

# Engine calls: forward light, backward dark (same hue: one micro-batch), the update orange.
CALL_COLOURS = {
    "forward": "#9ecae1",
    "backward": "#3182bd",
    "update": "#e6550d",  # a step() at the boundary
    "count": "#fdd0a2",  # a step() that only counts the micro-step (managed, not the boundary)
}
# Collectives by kind (gas_lab.measure.comm.KINDS): one colour per idea.
KIND_COLOURS = {
    "all_reduce": "#d62728",
    "all_gather": "#2ca02c",
    "reduce_scatter": "#9467bd",
    "broadcast": "#8c564b",
    "reduce": "#e377c2",
}
OTHER_COLOUR = "#7f7f7f"
LIBRARY_TITLES = {"gas_lab": "gas_lab", "deepspeed": "DeepSpeed"}

# Logical widths (time="logical"): an order, not durations.
WIDTHS = {"forward": 1.0, "backward": 1.5, "update": 1.2, "count": 0.5}
COLLECTIVE_WIDTH = 2.4  # room for "all_reduce" on one line, the bytes on a second
GAP = 0.2  # between a call's collectives
GATHERS = ("all_gather", "broadcast")  # what a step sends after its update: the new weights

ENGINE_LANE = (-0.42, 0.36)  # (offset from the row's centre, height), y grows downwards
COLLECTIVE_LANE = (0.0, 0.40)


@dataclass(frozen=True)
class Placed:
    """Where an event is drawn: ``x0``..``x1``; a collective's transfer starts at ``ready``
    (when the last rank arrived), before it the rank waits."""

    event: Event
    x0: float
    x1: float
    ready: float


def layout(events: Sequence[Event], time: str = "logical") -> list[Placed]:
    """Every event's place on the x axis (``time``: "logical" or "real", in ms)."""
    if time not in ("logical", "real"):
        raise ValueError(f"time {time!r}: choose 'logical' or 'real'")
    events = list(events)
    matched = _matched_collectives(events)
    if time == "real":
        ready = {}
        for group in matched:  # the transfer starts when the last rank calls
            last = max(events[i].start_ns for i in group)
            ready.update({i: last for i in group})
        return [
            Placed(e, e.start_ns / 1e6, e.end_ns / 1e6, ready.get(i, e.start_ns) / 1e6)
            for i, e in enumerate(events)
        ]
    return _logical(events, matched)


def _matched_collectives(events: list[Event]) -> list[list[int]]:
    """Indices of the k-th collective of every rank, for each k: one logical collective."""
    per_rank = {}
    for i, e in enumerate(events):
        if e.cat == "collective":
            per_rank.setdefault(e.rank, []).append(i)
    longest = max((len(v) for v in per_rank.values()), default=0)
    return [[v[k] for v in per_rank.values() if k < len(v)] for k in range(longest)]


def _width(e: Event) -> float:
    if e.name == "step":
        return WIDTHS["update" if e.boundary else "count"]
    return WIDTHS.get(e.name, 1.0)


def _tokens(events: list[Event], rank: int) -> list[tuple[str, object]]:
    """A rank's events as a walk: open a call, advance, meet a collective, ..., close it.

    A call's own work is drawn where it happens: a forward or backward computes before it
    reduces; a step updates after its reductions and before it gathers the updated weights.
    """
    mine = [i for i, e in enumerate(events) if e.rank == rank]
    calls = [i for i in mine if events[i].cat == "engine"]
    inside: dict[int | None, list[int]] = {c: [] for c in calls}
    for i in mine:
        if events[i].cat == "collective":
            parent = next((c for c in calls if events[i].within(events[c])), None)
            inside.setdefault(parent, []).append(i)
    top = sorted(calls + inside.pop(None, []), key=lambda i: events[i].start_ns)
    walk: list[tuple[str, object]] = []
    for i in top:
        e = events[i]
        if e.cat == "collective":
            walk.append(("collective", i))
            continue
        children = inside[i]
        work = 0
        if e.name == "step":  # after the reductions, before the first gather
            kinds = [events[c].kind for c in children]
            work = next((k for k, kind in enumerate(kinds) if kind in GATHERS), len(kinds))
        walk.append(("open", i))
        for k in range(len(children) + 1):
            walk.append(("advance", _width(e) if k == work else GAP if children else 0.0))
            if k < len(children):
                walk.append(("collective", children[k]))
        walk.append(("close", i))
    return walk


def _logical(events: list[Event], matched: list[list[int]]) -> list[Placed]:
    walks = {r: _tokens(events, r) for r in ranks(events)}
    at = dict.fromkeys(walks, 0)  # position in each walk
    x = dict.fromkeys(walks, 0.0)
    group_of = {i: k for k, group in enumerate(matched) for i in group}
    spans: dict[int, list[float]] = {}
    while True:
        waiting = {}  # rank -> the collective it stands at
        for r, walk in walks.items():
            while at[r] < len(walk):
                what, i = walk[at[r]]
                if what == "collective":
                    waiting[r] = i
                    break
                if what == "open":
                    spans[i] = [x[r], x[r], x[r]]
                elif what == "advance":
                    x[r] += i
                else:
                    spans[i][1] = x[r]
                at[r] += 1
        if not waiting:
            break
        # The earliest logical collective: every rank in it has arrived (the others are
        # waiting at a later one or are done), so it runs now, from the last arrival.
        k = min(group_of[i] for i in waiting.values())
        here = [r for r, i in waiting.items() if group_of[i] == k]
        ready = max(x[r] for r in here)
        for r in here:
            i = waiting[r]
            spans[i] = [x[r], ready + COLLECTIVE_WIDTH, ready]
            x[r] = ready + COLLECTIVE_WIDTH
            at[r] += 1
    return [Placed(e, *spans[i]) for i, e in enumerate(events)]


# ---------------------------------------------------------------- drawing
def plot_timeline(
    events: Sequence[Event],
    *,
    time: str = "logical",
    ax: Axes | None = None,
    title: str | None = None,
    legend: bool = True,
) -> Figure:
    """Draw ``events``: a row per rank (rank 0 on top), calls above, collectives below them."""
    rows = ranks(events)
    if ax is None:
        fig, ax = plt.subplots(figsize=(8.0, 1.0 + 1.05 * len(rows)), layout="constrained")
    else:
        fig = ax.figure
    placed = layout(events, time)
    row = {r: n for n, r in enumerate(rows)}
    for p in placed:
        (_draw_call if p.event.cat == "engine" else _draw_collective)(ax, p, row[p.event.rank])
    for x in _step_ends(placed):
        ax.axvline(x, color="black", linestyle="--", linewidth=1.2, zorder=3)
    ax.set_yticks(range(len(rows)), [f"rank {r}" for r in rows])
    ax.set_ylim(len(rows) - 0.5, -0.55)
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    if time == "logical":
        ax.set_xticks([])
        ax.set_xlabel("calls in their order on each rank (widths are not durations)")
    else:
        ax.set_xlabel("milliseconds since the start")
    ax.set_xlim(0, max(p.x1 for p in placed) * 1.02)  # the last step's line stays visible
    if title:
        ax.set_title(title)
    if legend:
        _legend(fig, [events])
    _fit_labels(fig)
    return fig


def _draw_call(ax: Axes, p: Placed, y: int):
    e = p.event
    kind = e.name if e.name != "step" else "update" if e.boundary else "count"
    off, height = ENGINE_LANE
    _bar(ax, y, ENGINE_LANE, p.x0, p.x1, color=CALL_COLOURS[kind], edgecolor="white", linewidth=1)
    if e.name in ("forward", "backward") and e.micro is not None:
        labels = [f"{e.name[0].upper()}{e.micro}"]
    elif kind == "update":
        labels = ["step"]
    else:
        return
    colour = "white" if kind in ("backward", "update") else "black"
    _label(ax, labels, (p.x0 + p.x1) / 2, y + off + height / 2, p.x1 - p.x0, colour)


def _draw_collective(ax: Axes, p: Placed, y: int):
    e = p.event
    colour = KIND_COLOURS.get(e.kind, OTHER_COLOUR)
    off, height = COLLECTIVE_LANE
    if p.ready > p.x0:  # waiting for the other ranks: hatched, pale
        waiting = {"color": "white", "edgecolor": colour, "hatch": "///", "linewidth": 0.8}
        _bar(ax, y, COLLECTIVE_LANE, p.x0, p.ready, **waiting)
    _bar(ax, y, COLLECTIVE_LANE, p.ready, p.x1, color=colour, edgecolor="white", linewidth=1)
    labels = [f"{e.kind}\n{_bytes(e.bytes)}", _bytes(e.bytes)]  # the kind, as in the legend
    width = p.x1 - p.ready
    _label(ax, labels, (p.ready + p.x1) / 2, y + off + height / 2, width, "white")


def _bar(ax: Axes, y: int, lane: tuple[float, float], x0: float, x1: float, **style):
    """A bar from ``x0`` to ``x1`` in ``lane`` (offset and height within rank ``y``'s row)."""
    off, height = lane
    ax.barh(y + off, x1 - x0, left=x0, height=height, align="edge", **style)


def _bytes(n: int) -> str:
    return f"{n:,} B" if n < 10_000 else f"{n / 1024:,.0f} KiB"


def _label(ax: Axes, candidates: list[str], x: float, y: float, width: float, colour: str):
    text = ax.text(
        x, y, candidates[0], ha="center", va="center", color=colour, linespacing=1.15, zorder=4
    )
    text._gas_lab_candidates = candidates  # the shorter spellings to try if it does not fit
    text._gas_lab_box = (x - width / 2, x + width / 2)
    text.set_in_layout(False)


def _fit_labels(fig: Figure) -> None:
    """Each label in its bar's width and its lane's height, else shorter, else hidden.

    Run once the figure is complete (legend, titles): the sizes measured are the final ones.
    """
    fig.draw_without_rendering()
    for ax in fig.axes:
        lane = ax.transData.transform([(0, 0), (0, ENGINE_LANE[1])])
        lane_px = abs(lane[1][1] - lane[0][1])
        for text in ax.texts:
            candidates = getattr(text, "_gas_lab_candidates", None)
            if candidates is None:
                continue
            left, right = ax.transData.transform([(b, 0) for b in text._gas_lab_box])
            room = (right[0] - left[0]) * 0.92
            text.set_visible(True)  # an invisible text measures as nothing
            for candidate in candidates:
                text.set_text(candidate)
                box = text.get_window_extent()
                if box.width <= room and box.height <= lane_px * 1.05:
                    break
            else:
                text.set_visible(False)


def _step_ends(placed: list[Placed]) -> list[float]:
    """Where each optimizer step has ended on every rank: after the last rank's update."""
    ends: dict[int, float] = {}
    for p in placed:
        e = p.event
        if e.cat == "engine" and e.name == "step" and e.boundary:
            ends[e.step] = max(ends.get(e.step, 0.0), p.x1)
    return sorted(ends.values())


def _legend(fig: Figure, runs: Sequence[Sequence[Event]]) -> None:
    events = [e for run in runs for e in run]
    steps = [e for e in events if e.cat == "engine" and e.name == "step"]
    handles = [
        Patch(color=CALL_COLOURS["forward"], label="forward (F)"),
        Patch(color=CALL_COLOURS["backward"], label="backward (B)"),
        Patch(color=CALL_COLOURS["update"], label="step (updates)"),
    ]
    if any(not e.boundary for e in steps):
        handles.append(Patch(color=CALL_COLOURS["count"], label="step (counts only)"))
    kinds = sorted({c.kind for c in collectives(events)}, key=list(KIND_COLOURS).index)
    handles += [Patch(color=KIND_COLOURS.get(k, OTHER_COLOUR), label=k) for k in kinds]
    if any(p.ready > p.x0 for run in runs for p in layout(run) if p.event.cat == "collective"):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="waiting"))
    handles.append(plt.Line2D([], [], color="black", linestyle="--", label="step done"))
    fig.legend(handles=handles, loc="outside lower center", ncol=4, frameon=False)


def plot_side_by_side(
    runs: Mapping[str, Sequence[Event]], *, time: str = "logical", title: str | None = None
) -> Figure:
    """One timeline per run, stacked in the order given, each titled by its key ("gas_lab" and
    "deepspeed" read as the libraries' names), on one x axis in logical time: the same sequence
    looks the same. ``{"gas_lab": ours, "deepspeed": theirs}`` puts gas_lab above DeepSpeed."""
    n_rows = sum(len(ranks(ev)) for ev in runs.values())
    fig, axes = plt.subplots(
        len(runs),
        1,
        figsize=(8.0, 1.0 + 1.05 * n_rows + 0.4 * len(runs)),
        layout="constrained",
        sharex=time == "logical",
    )
    axes = [axes] if len(runs) == 1 else list(axes)
    for ax, (name, events) in zip(axes, runs.items(), strict=True):
        plot_timeline(events, time=time, ax=ax, legend=False)
        ax.set_title(LIBRARY_TITLES.get(name, name), loc="left")
        if ax is not axes[-1]:
            ax.set_xlabel("")
    if time == "logical":  # one shared axis: wide enough for the longest run
        longest = max(max(p.x1 for p in layout(events)) for events in runs.values())
        axes[0].set_xlim(0, longest * 1.02)
    _legend(fig, list(runs.values()))
    if title:
        fig.suptitle(title)
    _fit_labels(fig)
    return fig
