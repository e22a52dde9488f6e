"""Counting collectives, so a lesson can print what a training step costs in communication.

::

    with count_collectives() as log:
        train_one_step()
    print(log.summary(steps=1))   # e.g. all_reduce: 2 calls, 1,160 bytes

While the block runs, the collective functions of ``torch.distributed`` (and, if DeepSpeed is
imported, of ``deepspeed.comm``, through which DeepSpeed makes all its calls) are replaced by
thin wrappers that record each call, then call the original. One logical call is recorded once:
``deepspeed.comm.all_reduce`` calls ``torch.distributed.all_reduce`` underneath, and only the
outer one counts.

Measured with DeepSpeed 0.19.8 on CPU (gloo, 2 ranks, fp32, clipping on, one bucket):
stage 0 does 1 all_reduce of the gradients at the boundary plus 1 all_reduce of the 4-byte
gradient norm (clipping); stage 1 does the same 2 all_reduces plus 1 all_gather_into_tensor of
the updated parameter shards. Both broadcast every parameter once at initialize. Stage 2
all-reduces in every backward(); stage 3 also gathers weights in forward() and reduce-scatters
in backward() (lesson 09 counts them phase by phase: :class:`Phase`).

:func:`ring_bytes` turns a log into a *model* of the bytes each rank sends on a ring. Each call
also keeps when it ran and the torch.distributed function it reached, for timelines
(:mod:`gas_lab.measure.recording`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# Function name -> the kind of collective it is. Several spellings exist for one idea.
KINDS = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "inference_all_reduce": "all_reduce",
    "reduce": "reduce",
    "broadcast": "broadcast",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_coalesced": "all_gather",
    "allgather_fn": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_fn": "reduce_scatter",
    "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all",
    # older and object spellings, and barriers (ZeRO-3 synchronizes its start-up with them)
    "_all_gather_base": "all_gather",
    "_reduce_scatter_base": "reduce_scatter",
    "all_gather_object": "all_gather",
    "broadcast_object_list": "broadcast",
    "barrier": "barrier",
    "monitored_barrier": "barrier",
}
# Where callers look the functions up. deepspeed.comm re-exports deepspeed.comm.comm's
# functions, and some DeepSpeed helpers call the inner module's names directly.
NAMESPACES = (
    "torch.distributed",
    "torch.distributed.distributed_c10d",
    "deepspeed.comm",
    "deepspeed.comm.comm",
)


@dataclass(frozen=True)
class Collective:
    kind: str  # all_reduce, all_gather, reduce_scatter, broadcast, reduce, all_to_all
    function: str  # what was called, e.g. "deepspeed.comm.all_gather_into_tensor"
    bytes: int  # size of the full buffer: the largest tensor argument (a list counts summed)
    group_size: int  # ranks taking part
    dtype: str = ""  # of the first tensor argument, e.g. "float32" ("" for a barrier)
    # For timelines (gas_lab.measure.recording), left out of comparisons: the torch.distributed
    # function the call reached ("all_gather_into_tensor" under DeepSpeed's allgather_fn), and
    # time.perf_counter_ns() when the call entered and left the wrapper.
    op: str = field(default="", compare=False)
    start_ns: int = field(default=0, compare=False)
    end_ns: int = field(default=0, compare=False)


class CollectiveLog:
    """The collectives recorded in one ``count_collectives()`` block, in call order.

    With ``keep_tensors``, ``tensors[i]`` is ``(handed, result)`` for ``calls[i]``: copies of
    its first tensor argument as it was handed over and as it came back (an in-place
    collective's result), or None for a call without one (a barrier)."""

    def __init__(self, keep_tensors: bool = False):
        self.calls: list[Collective] = []
        self.keep_tensors = keep_tensors
        self.tensors: list[tuple[torch.Tensor, torch.Tensor] | None] = []

    def __len__(self) -> int:
        return len(self.calls)

    def count(self, kind: str | None = None) -> int:
        return sum(1 for c in self.calls if kind is None or c.kind == kind)

    def total_bytes(self, kind: str | None = None) -> int:
        return sum(c.bytes for c in self.calls if kind is None or c.kind == kind)

    def by_kind(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for c in self.calls:
            row = out.setdefault(c.kind, {"calls": 0, "bytes": 0})
            row["calls"] += 1
            row["bytes"] += c.bytes
        return out

    def summary(self, steps: int | None = None) -> str:
        """One line per kind; with ``steps``, also per optimizer step."""
        if not self.calls:
            return "no collectives"
        lines = []
        for kind, row in self.by_kind().items():
            line = f"{kind}: {row['calls']} calls, {row['bytes']:,} bytes"
            if steps:
                line += f" ({row['calls'] / steps:g} calls per step)"
            lines.append(line)
        return "\n".join(lines)


_active: list[CollectiveLog] = []  # open blocks (they may nest); every call goes to each
_saved: list[tuple[object, str, object]] = []  # (namespace, name, original) to restore
_depth = threading.local()  # n > 0 while inside a recorded call: inner calls are not recorded;
# op: the torch.distributed function the outer call has reached so far
_lock = threading.Lock()


@contextlib.contextmanager
def count_collectives(keep_tensors: bool = False):
    """Record every collective issued inside the block (by gas_lab, torch or DeepSpeed).

    ``keep_tensors=True`` also copies what each call was handed and what it returned
    (``log.tensors``): lesson 08 reads where the division by the world size happens."""
    log = CollectiveLog(keep_tensors)
    with _lock:
        if not _active:
            _install()
        _active.append(log)
    try:
        yield log
    finally:
        with _lock:
            _active.remove(log)
            if not _active:
                _uninstall()


def _install():
    for ns_name in NAMESPACES:
        namespace = sys.modules.get(ns_name)  # DeepSpeed only if already imported
        if namespace is None:
            continue
        for name in KINDS:
            original = getattr(namespace, name, None)
            if callable(original):
                _saved.append((namespace, name, original))
                setattr(namespace, name, _recording(original, f"{ns_name}.{name}", name))


def _uninstall():
    while _saved:
        namespace, name, original = _saved.pop()
        setattr(namespace, name, original)


def _recording(original, qualified: str, name: str):
    try:
        signature = inspect.signature(original)
    except (TypeError, ValueError):
        signature = None

    torch_name = _is_torch_function(name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        depth = getattr(_depth, "n", 0)
        if depth > 0:  # inside a recorded call: only note which torch function it reached
            if torch_name and _depth.op is None:
                _depth.op = name
            _depth.n = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                _depth.n = depth
        logs = list(_active)
        described = (_payload(args, kwargs), _size(signature, args, kwargs), _dtype(args, kwargs))
        first = _first_tensor(args, kwargs) if any(log.keep_tensors for log in logs) else None
        handed = first.detach().clone() if first is not None else None
        _depth.n, _depth.op = 1, name if torch_name else None
        start = time.perf_counter_ns()
        try:
            return original(*args, **kwargs)
        finally:
            end = time.perf_counter_ns()
            call = Collective(
                KINDS[name], qualified, *described, op=_depth.op or name, start_ns=start, end_ns=end
            )
            _depth.n, _depth.op = 0, None
            kept = (handed, first.detach().clone()) if first is not None else None
            for log in logs:
                log.calls.append(call)
                if log.keep_tensors:
                    log.tensors.append(kept)

    return wrapper


def _is_torch_function(name: str) -> bool:
    # DeepSpeed's own spellings (allgather_fn, inference_all_reduce) are not torch's.
    return callable(getattr(dist.distributed_c10d, name, None))


def _payload(args, kwargs) -> int:
    def nbytes(value) -> int:
        if torch.is_tensor(value):
            return value.numel() * value.element_size()
        if isinstance(value, (list, tuple)):
            return sum(nbytes(v) for v in value)
        return 0

    return max((nbytes(v) for v in (*args, *kwargs.values())), default=0)


def _first_tensor(args, kwargs) -> torch.Tensor | None:
    return next((v for v in (*args, *kwargs.values()) if torch.is_tensor(v)), None)


def _size(signature, args, kwargs) -> int:
    group = kwargs.get("group")
    if group is None and signature is not None:
        with contextlib.suppress(TypeError):
            group = signature.bind_partial(*args, **kwargs).arguments.get("group")
    try:
        return dist.get_world_size(group)
    except (RuntimeError, ValueError, TypeError):
        return 1


def _dtype(args, kwargs) -> str:
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)) and value:
            value = value[0]
        if torch.is_tensor(value):
            return str(value.dtype).removeprefix("torch.")
    return ""


@dataclass
class Phase:
    """The collectives of one call of a training loop: ``what`` is "initialize", "forward",
    "backward" or "step"; ``step`` the optimizer step (-1 at initialize), ``micro`` the
    micro-batch (None for an unmanaged step())."""

    what: str
    step: int
    micro: int | None
    calls: list[Collective]

    @property
    def bytes(self) -> int:
        return sum(c.bytes for c in self.calls)

    def signature(self) -> list[tuple[str, int]]:
        """(kind, bytes) of each call, in order: what two libraries must agree on."""
        return [(c.kind, c.bytes) for c in self.calls]


def bytes_per_step(phases: list[Phase], ring: int | None = None) -> list[int | float]:
    """Bytes of every optimizer step's collectives (initialize left out), in step order.

    ``ring=W``: the ring model of :func:`ring_bytes` instead of the buffers' bytes.
    """
    steps = sorted({p.step for p in phases if p.what != "initialize"})
    out = []
    for step in steps:
        calls = [c for p in phases if p.step == step and p.what != "initialize" for c in p.calls]
        out.append(sum(c.bytes for c in calls) if ring is None else ring_bytes(calls, ring))
    return out


# On a ring of W ranks each rank sends this many times (W-1)/W of a call's buffer.
RING_FACTOR = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1}


def ring_bytes(calls, world_size: int) -> float:
    """A model, not a measurement: bytes each rank sends for ``calls`` (a log or a list) on a
    ring. An all-reduce is a reduce-scatter then an all-gather, 2(W-1)/W of its buffer; a
    reduce-scatter, an all-gather or a (pipelined) broadcast (W-1)/W; a barrier nothing."""
    calls = calls.calls if isinstance(calls, CollectiveLog) else calls
    share = (world_size - 1) / world_size
    return sum(RING_FACTOR.get(c.kind, 0) * share * c.bytes for c in calls)
