"""A recording as a Chrome trace (``traceEvents``, complete events, ``pid`` = rank, ``cat``
"engine" / "collective", ``args.bytes``): what ``python -m gas_lab.timeline`` writes, and opens
in Perfetto or ``chrome://tracing``. :func:`chrome_trace` writes one from
:mod:`gas_lab.measure.recording`'s events; :func:`validate_trace` checks one.
"""

from __future__ import annotations

from collections.abc import Sequence

from gas_lab.measure.comm import KINDS
from gas_lab.measure.recording import ENGINE_CALLS, Event, ranks

LANE = 0  # one lane per rank: a collective nests under the call it ran inside
LANE_NAME = "engine calls and collectives"


def chrome_trace(events: Sequence[Event], **metadata) -> dict:
    """The events as a Chrome trace (JSON object format): ``pid`` = rank, complete events
    (``"ph": "X"``) with ``ts``/``dur`` in microseconds, ``cat`` "engine" or "collective".
    ``metadata`` (library, stage, ...) goes to ``otherData``."""
    out: list[dict] = []
    for rank in ranks(events):
        out += [
            {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}},
            {
                "name": "thread_name",
                "ph": "M",
                "pid": rank,
                "tid": LANE,
                "args": {"name": LANE_NAME},
            },
        ]
    for e in sorted(events, key=lambda e: (e.rank, e.start_ns, e.cat != "engine")):
        args = {"step": e.step, "micro_batch": e.micro}
        if e.cat == "engine" and e.name == "step":
            args["boundary"] = e.boundary
        if e.cat == "collective":
            args.update(
                bytes=e.bytes,
                kind=e.kind,
                group_size=e.group_size,
                dtype=e.dtype,
                called=e.function,
                inside=e.parent or None,
            )
        out.append(
            {
                "name": e.name,
                "cat": e.cat,
                "ph": "X",
                # integer ns -> µs with 3 decimals: exact, so a child never pokes out of its parent
                "ts": e.start_ns / 1000,
                "dur": (e.end_ns - e.start_ns) / 1000,
                "pid": e.rank,
                "tid": LANE,
                "args": args,
            }
        )
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": metadata}


def validate_trace(trace: object) -> list[str]:
    """What is wrong with ``trace`` as a timeline Chrome trace ([] when nothing is).

    Checks the format the command promises: ``{"traceEvents": [...]}``; complete events with
    name, cat ("engine" named forward/backward/step, or "collective" with ``args.bytes``), ph
    "X", numeric ``ts`` and ``dur`` >= 0 (µs), integer ``pid`` (the rank) and ``tid``; a
    ``process_name`` metadata event for every pid; a collective that starts inside an engine
    call ends inside it too.
    """
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ['not a JSON object with a "traceEvents" list']
    problems: list[str] = []
    named, spans = set(), {}
    for i, t in enumerate(trace["traceEvents"]):
        found = _event_problems(t)
        problems += [f"traceEvents[{i}]: {p}" for p in found]
        if found:
            continue
        if t["ph"] == "M" and t["name"] == "process_name":
            named.add(t["pid"])
        elif t["ph"] == "X":
            spans.setdefault((t["pid"], t["tid"]), []).append((t["ts"], t["ts"] + t["dur"], i))
    for pid in sorted({p for p, _ in spans} - named):
        problems.append(f'pid {pid}: no "process_name" metadata event')
    for lane in spans.values():  # complete events on one lane must nest, never overlap
        open_: list[tuple[float, float, int]] = []
        for start, end, i in sorted(lane, key=lambda s: (s[0], -s[1])):
            while open_ and open_[-1][1] <= start:
                open_.pop()
            if open_ and end > open_[-1][1]:
                problems.append(
                    f"traceEvents[{i}]: overlaps traceEvents[{open_[-1][2]}] without nesting"
                )
            open_.append((start, end, i))
    return problems


def _event_problems(t: object) -> list[str]:
    if not isinstance(t, dict):
        return ["not an object"]
    problems = []
    if not _is_int(t.get("pid")):
        problems.append(f"pid {t.get('pid')!r} is not an integer rank")
    ph = t.get("ph")
    if ph == "M":
        return problems
    if ph != "X":
        return [*problems, f'ph {ph!r}, expected "X" (complete) or "M" (metadata)']
    for key in ("ts", "dur"):
        value = t.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            problems.append(f"{key} {value!r} is not a number >= 0 (µs)")
    if not _is_int(t.get("tid")):
        problems.append(f"tid {t.get('tid')!r} is not an integer")
    cat, name, args = t.get("cat"), t.get("name"), t.get("args")
    if cat == "engine":
        if name not in ENGINE_CALLS:
            problems.append(f"engine call {name!r} is not one of {', '.join(ENGINE_CALLS)}")
    elif cat == "collective":
        if name not in KINDS:
            problems.append(f"{name!r} is not a torch.distributed collective")
        nbytes = args.get("bytes") if isinstance(args, dict) else None
        if not _is_int(nbytes) or nbytes < 0:
            problems.append(f"args.bytes {nbytes!r} is not a byte count")
    else:
        problems.append(f'cat {cat!r}, expected "engine" or "collective"')
    return problems


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
