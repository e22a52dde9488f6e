"""Recording *when* each rank runs its ``forward``, ``backward`` and ``step`` calls, and which
collectives each call issues, for gas_lab and for DeepSpeed alike.

::

    with record(engine) as events:        # on every rank
        ...training loop...
    # events: this rank's engine calls and collectives, with start and end times

:func:`record` wraps the engine *instance*'s ``forward``, ``backward`` and ``step`` (the public
API both libraries share) and records the collectives with
:func:`gas_lab.measure.comm.count_collectives`, so a collective issued inside ``backward()``
lies inside that call's span. Times are ``time.perf_counter_ns()`` minus an origin taken right
after a barrier, so the ranks' rows line up. A collective is named as the ``torch.distributed``
function it reached (``all_reduce``, ``all_gather_into_tensor``, ...), whichever library issued it,
so the two libraries' records compare event by event.

:func:`record_loop` does the same for a plain PyTorch loop with no engine (torch DDP's: the
model's forward, ``Tensor.backward()``, the optimizer's step).

:func:`record_run` is the loop of ``python -m gas_lab.timeline`` (one toy model, one config,
either library, ``micro_batches[r]`` micro-batches on rank r); :func:`record_on` runs it on a
notebook's ranks. :mod:`gas_lab.measure.chrome_trace` turns events into a Chrome trace;
:mod:`gas_lab.lessons.timeline_plots` draws them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gas_lab.measure.comm import KINDS, count_collectives
from gas_lab.measure.parity import initializer, quiet_deepspeed
from gas_lab.toys import micro_batch, tiny_model

ENGINE_CALLS = ("forward", "backward", "step")
LIBRARIES = ("gas_lab", "deepspeed")
STAGES = (0, 1, 2)  # gas_lab builds stages 0-2, so both libraries compare there
MODES = ("managed", "unmanaged")
MICRO_BATCH_SIZE = 2  # samples per micro-batch, as in the lessons


@dataclass(frozen=True)
class Event:
    """One engine call or one collective on one rank; times in ns since the run's origin."""

    rank: int
    cat: str  # "engine" or "collective"
    name: str  # forward / backward / step, or the torch.distributed function
    start_ns: int
    end_ns: int
    step: int | None  # the optimizer step (0-based) the call belongs to
    micro: int | None  # its micro-batch within that step; None for an unmanaged step()
    boundary: bool = False  # a step() that updated the weights (global_steps advanced)
    bytes: int = 0  # collectives: the full buffer, as gas_lab.measure.comm counts it
    group_size: int = 0
    dtype: str = ""
    function: str = ""  # collectives: what was called, e.g. "deepspeed.comm.allgather_fn"
    parent: str = ""  # collectives: the engine call they ran inside ("" for none)

    @property
    def kind(self) -> str:
        """A collective's kind (all_reduce, all_gather, ...), one word per idea."""
        return KINDS.get(self.name, self.name)

    def within(self, other: Event) -> bool:
        return other.start_ns <= self.start_ns and self.end_ns <= other.end_ns


def origin_ns() -> int:
    """The run's time origin on this rank: right after a barrier, so rows line up."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return time.perf_counter_ns()


@contextlib.contextmanager
def record(engine, origin: int | None = None, forward_s: float = 0.0):
    """Record ``engine``'s calls and the collectives inside the block (on every rank).

    Yields a list that is filled, in start order, when the block ends. Call and micro-batch
    indices are counted here: ``step`` = boundaries so far, ``micro`` = backward() calls since
    the last boundary.

    ``forward_s`` makes every forward inside the block that many seconds longer, as for a model
    bigger than the tiny ones here: theirs take about a millisecond, within the scheduling noise
    of a shared 2-core machine, where a rank's wait of a few milliseconds was measured the wrong
    way round in repeated runs.
    """
    managed = engine.managed_gradient_accumulation()
    calls = [(engine, name, name) for name in ENGINE_CALLS]  # engine(x) and .step() find them
    steps = {"before": 0}

    def before(name):
        steps["before"] = engine.global_steps

    def boundary(name):  # a step() that updated: global_steps advanced
        return name == "step" and engine.global_steps != steps["before"]

    with contextlib.ExitStack() as block:
        if forward_s:  # a hook only when asked: it stays out of every other recording
            hook = engine.module.register_forward_pre_hook(lambda *_: time.sleep(forward_s))
            block.callback(hook.remove)
        with _recording(calls, before, boundary, managed, origin) as events:
            yield events


@contextlib.contextmanager
def record_loop(model, optimizer, origin: int | None = None):
    """Record a plain PyTorch loop, one with no engine (torch DDP's, lesson 02), the way
    :func:`record` records an engine (on every rank).

    ``model(x)`` is a ``forward``, every ``Tensor.backward()`` inside the block a ``backward``,
    and every ``optimizer.step()`` a ``step`` that updates (the boundary). Yields the list of
    events, filled when the block ends.
    """
    calls = [(model, "forward", "forward"), (torch.Tensor, "backward", "backward"),
             (optimizer, "step", "step")]  # fmt: skip
    with _recording(calls, lambda name: None, lambda name: name == "step", False, origin) as events:
        yield events


@contextlib.contextmanager
def _recording(targets, before, boundary, managed: bool, origin: int | None):
    """Wrap each ``(owner, attribute, call name)`` of ``targets`` for the block, and record the
    collectives; ``before(name)`` runs as a call starts, ``boundary(name)`` says whether it
    ended an optimizer step."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    origin = origin_ns() if origin is None else origin
    calls: list[Event] = []
    state = {"step": 0, "micro": 0, "depth": 0}

    def timed(name, original):
        def call(*args, **kwargs):
            if state["depth"]:  # the engine calling itself: one call, recorded once
                return original(*args, **kwargs)
            step, micro = state["step"], state["micro"]
            if name == "step":
                micro = micro - 1 if managed else None  # managed: the micro-step it closes
            before(name)
            state["depth"] += 1
            start = time.perf_counter_ns()
            try:
                return original(*args, **kwargs)
            finally:
                end = time.perf_counter_ns()
                state["depth"] -= 1
                ended = boundary(name)
                calls.append(
                    Event(rank, "engine", name, start - origin, end - origin, step, micro, ended)
                )
                if name == "backward":
                    state["micro"] += 1
                if ended:
                    state["step"], state["micro"] = state["step"] + 1, 0

        return call

    events: list[Event] = []
    saved = []  # (owner, attribute, what its own __dict__ held): restored exactly
    for owner, attribute, name in targets:
        saved.append((owner, attribute, vars(owner).get(attribute, _ABSENT)))
        setattr(owner, attribute, timed(name, getattr(owner, attribute)))
    try:
        with count_collectives() as log:
            yield events
    finally:
        for owner, attribute, own in reversed(saved):
            if own is _ABSENT:  # the instance had none: it finds its class's again
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, own)
    events.extend(calls)
    for c in log.calls:
        start, end = c.start_ns - origin, c.end_ns - origin
        parent = next((e for e in calls if e.start_ns <= start and end <= e.end_ns), None)
        events.append(
            Event(
                rank,
                "collective",
                c.op,
                start,
                end,
                parent.step if parent else None,
                parent.micro if parent else None,
                bytes=c.bytes,
                group_size=c.group_size,
                dtype=c.dtype,
                function=c.function,
                parent=parent.name if parent else "",
            )
        )
    # Start order; a call before the collectives it contains.
    events.sort(key=lambda e: (e.start_ns, e.cat != "engine"))


_ABSENT = object()


class PlanError(ValueError):
    """A run that cannot be recorded, with the argument to blame (``micro_batches``, ...)."""

    def __init__(self, argument: str, reason: str):
        super().__init__(f"{argument}: {reason}")
        self.argument, self.reason = argument, reason


def check_plan(
    library: str, stage: int, mode: str, micro_batches: Sequence[int], steps: int, world: int
) -> list[int]:
    """The micro-batches of each rank, or a :class:`PlanError` naming what is wrong.

    One count means every rank runs that many. Managed, the counts must be equal (it is
    ``gradient_accumulation_steps``). At stage 2 every ``backward()`` reduces, so every rank
    must call it equally often: different counts are refused rather than run, because
    DeepSpeed then pairs one rank's gradient reduction with another's norm and raises or hangs.
    """
    if library not in LIBRARIES:
        raise PlanError("library", f"{library!r} is not one of {', '.join(LIBRARIES)}")
    if stage not in STAGES:
        raise PlanError(
            "stage", f"{stage!r}: choose 0, 1 or 2 (gas_lab builds ZeRO stages 0-2 only)"
        )
    if mode not in MODES:
        raise PlanError("mode", f"{mode!r} is not one of {', '.join(MODES)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise PlanError("steps", f"{steps!r}: at least 1 optimizer step")
    counts = list(micro_batches)
    shown = ",".join(str(n) for n in counts)
    if not counts or any(isinstance(n, bool) or not isinstance(n, int) for n in counts):
        raise PlanError("micro_batches", f"{shown or 'nothing'}: whole numbers, one per rank")
    if len(counts) == 1:
        counts = counts * world
    if len(counts) != world:
        raise PlanError(
            "micro_batches",
            f"{shown} gives {len(counts)} counts for {world} rank{'s' * (world > 1)}: one count "
            "per rank (or one for all)",
        )
    if min(counts) < 1:
        raise PlanError("micro_batches", f"{shown}: every rank needs at least 1 micro-batch")
    if len(set(counts)) > 1 and mode == "managed":
        raise PlanError(
            "micro_batches",
            f"{shown} differ, but managed mode runs gradient_accumulation_steps micro-batches "
            "on every rank: use equal counts, or mode unmanaged",
        )
    if len(set(counts)) > 1 and stage == 2:
        raise PlanError(
            "micro_batches",
            f"{shown} differ at stage 2, where every backward() reduces gradients: the ranks "
            "would pair different collectives (DeepSpeed raises or hangs); use equal counts, "
            "or stage 0/1",
        )
    return counts


def config(stage: int, mode: str, gas: int, gradient_clipping: float = 1.0) -> dict:
    """The run's DeepSpeed config: Adam from torch (no fused-Adam build), micro-batches of 2,
    clipping explicit (1.0 is DeepSpeed's default; it adds a 4-byte norm all_reduce)."""
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH_SIZE,
        "gradient_accumulation_steps": gas,
        "managed_gradient_accumulation": mode == "managed",
        "gradient_clipping": gradient_clipping,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "steps_per_print": 10**9,
    }


def _initialize(library: str):
    if library == "deepspeed":
        # Its start-up report (config, memory) would bury the timeline's own lines.
        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    return initializer(library)


def record_run(
    library: str = "gas_lab",
    stage: int = 0,
    mode: str = "managed",
    micro_batches: Sequence[int] = (2,),
    steps: int = 1,
    gradient_clipping: float = 1.0,
    seed: int = 0,
    forward_s: float = 0.0,
) -> list[Event]:
    """Train ``steps`` optimizer steps and return this rank's events (call on every rank).

    Rank r runs ``micro_batches[r]`` micro-batches per step. Managed: ``step()`` after every
    micro-batch, ``gradient_accumulation_steps`` = the count. Unmanaged: one ``step()`` after
    the rank's micro-batches, each loss divided by the rank's own count with
    ``scale_wrt_gas=False`` (with different counts per rank lesson 04's global count is the
    right divisor; its extra all-reduce is left out so the trace holds the engine's
    collectives only). Initialize's broadcasts are not recorded. ``forward_s``: see
    :func:`record`.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    counts = check_plan(library, stage, mode, micro_batches, steps, world)
    managed, n = mode == "managed", counts[rank]
    model = tiny_model(seed)
    engine = _initialize(library)(
        model=model,
        model_parameters=model.parameters(),
        config=config(stage, mode, counts[0], gradient_clipping),
    )[0]
    with record(engine, forward_s=forward_s) as events, quiet_deepspeed():
        for step in range(steps):
            for micro in range(n):
                x, y = micro_batch(seed, step, micro, rank, MICRO_BATCH_SIZE)
                loss = torch.nn.functional.mse_loss(engine(x), y)
                if managed:
                    engine.backward(loss)
                    engine.step()
                else:
                    engine.backward(loss / n, scale_wrt_gas=False)
            if not managed:
                engine.step()
    return events


def record_on(cluster, **kwargs) -> list[Event]:
    """:func:`record_run` on a notebook's ranks (``gas_lab.start_cluster()``): every rank's
    events, rank 0's first."""
    return [e for events in cluster.run(record_run, **kwargs) for e in events]


def gather(events: list[Event]) -> list[Event] | None:
    """Every rank's events on rank 0 (None elsewhere); call on every rank, after recording."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(events)
    everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(list(events), everyone, dst=0)
    return None if everyone is None else [e for events in everyone for e in events]


# ---------------------------------------------------------------- queries
def ranks(events: Sequence[Event]) -> list[int]:
    return sorted({e.rank for e in events})


def collectives(events: Sequence[Event], rank: int | None = None) -> list[Event]:
    """The collectives (of ``rank``), in start order."""
    return [e for e in events if e.cat == "collective" and rank in (None, e.rank)]


def calls(events: Sequence[Event], rank: int | None = None, name: str | None = None) -> list[Event]:
    """The engine calls (of ``rank``, named ``name``), in start order."""
    return [
        e for e in events if e.cat == "engine" and rank in (None, e.rank) and name in (None, e.name)
    ]


def signature(events: Sequence[Event], rank: int) -> list[tuple[str, str, int]]:
    """(engine call, collective, bytes) of every collective of ``rank``, in order: what two
    libraries must agree on."""
    return [(c.parent, c.name, c.bytes) for c in collectives(events, rank)]


# ---------------------------------------------------------------- Chrome trace
def describe(events: Sequence[Event], rank: int) -> str:
    """One line: what ``rank`` did, e.g. ``rank 0: 2 forward, 2 backward, 2 step; all_reduce
    232 B in backward, all_reduce 4 B in step``."""
    counts = {n: len(calls(events, rank, n)) for n in ENGINE_CALLS}
    head = ", ".join(f"{v} {k}" for k, v in counts.items())
    colls = ", ".join(
        f"{c.name} {c.bytes} B" + (f" in {c.parent}" if c.parent else "")
        for c in collectives(events, rank)
    )
    return f"rank {rank}: {head}; {colls or 'no collectives'}"
