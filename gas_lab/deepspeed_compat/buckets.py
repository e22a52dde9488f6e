"""Which collectives carry the gradient at the boundary: DeepSpeed 0.19.8's buckets, stage 0 and 1.

Every rank walks its gradients in parameter order and cuts them into **buckets**; each bucket
travels in one collective (or a few). The division by the world size W happens before or after
the sum, as DeepSpeed does it (the mean is the same; the last bit may differ when W is not a
power of two).

* **Stage 0** (and stage 1 with bf16 + fp32 accumulation, DeepSpeed's ``BF16_Optimizer``):
  buckets of a fixed 5e8 elements, one ``all_reduce`` each; ``zero_optimization`` is not read.
  ``prescale_gradients`` multiplies by 1/W before the sum; otherwise (the default) the sum is
  multiplied by ``gradient_predivide_factor`` f before (1/f) and after (f/W).
* **Stage 1** (``DeepSpeedZeroOptimizer``): buckets of ``reduce_bucket_size`` elements (a
  parameter that does not fit closes the bucket; one larger than it travels alone). Then, per
  bucket, following ``zero_optimization``:

  - ``contiguous_gradients`` false: one ``all_reduce``, divided by W first;
  - ``reduce_scatter`` false: one ``all_reduce``, scaled as at stage 0;
  - the default: divide by W, cut the bucket where the owner of the elements changes (the
    ranks' shards, :class:`gas_lab.zero1.Layout`), then with ``use_multi_rank_bucket_allreduce``
    true (its default) ``all_reduce`` the pieces, or with it false ``reduce`` each owner's
    pieces to that owner; either way in chunks of ``reduce_bucket_size`` elements.

  DeepSpeed's stage 1 never issues a reduce-scatter; ``gas_lab.zero1``'s ``"reduce_scatter"``
  reduction is the textbook variant lesson 05 compares with.

``stage1_calls`` returns the plan as data (:class:`Call`), so a lesson can print it. With
``round_robin_gradients`` the parameters are laid into the flat vector in DeepSpeed's
round-robin order (:func:`round_robin`), which changes who owns which element, not the numbers.
:class:`Zero1Plan` is what :class:`gas_lab.deepspeed_compat.zero.Zero1` is given to run all
that, and
:class:`Division` where the config puts the division by W.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# DeepSpeed's stage-0 bucket, in elements: a small model's gradients fit in one all-reduce.
STAGE0_BUCKET_ELEMENTS = 500_000_000


@dataclass(frozen=True)
class Piece:
    """Elements [start, end) of param group ``group``'s flat gradient, owned by rank ``owner``."""

    group: int
    start: int
    end: int
    owner: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Call:
    """One collective: ``all_reduce`` (``dst`` None) or ``reduce`` to ``dst``, of ``pieces``."""

    kind: str
    pieces: tuple[Piece, ...]
    dst: int | None = None
    scaling: str = "divide_first"  # "divide_first", "engine", "predivide" or "none"

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.pieces)


def _buckets(params: list[tuple[int, int, int]], size: int) -> list[list[tuple[int, int, int]]]:
    """(group, start, end) of each parameter, cut into consecutive buckets as DeepSpeed does."""
    out, bucket, elements = [], [], 0
    for param in params:
        numel = param[2] - param[1]
        if elements + numel > size and bucket:
            out.append(bucket)
            bucket, elements = [], 0
        bucket.append(param)
        elements += numel
    return out + ([bucket] if bucket else [])


def _chunks(slices: list[list[Piece]], size: int) -> list[tuple[Piece, ...]]:
    """Slices grouped until their total exceeds ``size`` (that slice included)."""
    out, chunk, numel = [], [], 0
    for pieces in slices:
        chunk += pieces
        numel += sum(p.numel for p in pieces)
        if numel > size:
            out.append(tuple(chunk))
            chunk, numel = [], 0
    return out + ([tuple(chunk)] if chunk else [])


def stage1_calls(groups, zero, average: bool = True) -> list[Call]:
    """The collectives DeepSpeed's stage 1 issues under ``zero`` (the config's
    ``zero_optimization``). ``groups``: per param group, ``(walk, shard_size)``, where ``walk``
    lists each parameter's ``(offset, numel)`` in the flat vector, in parameter order (the
    order backward's gradients are bucketed in). The bucket spans param groups, as DeepSpeed's
    does."""
    params = [(g, off, off + n) for g, (walk, _) in enumerate(groups) for off, n in walk if n]
    calls: list[Call] = []
    size = zero.reduce_bucket_size
    for bucket in _buckets(params, size):
        whole = tuple(Piece(g, s, e, -1) for g, s, e in bucket)
        if not zero.contiguous_gradients:
            calls.append(Call("all_reduce", whole, scaling="divide_first" if average else "none"))
            continue
        if not zero.reduce_scatter:
            calls.append(Call("all_reduce", whole, scaling="predivide"))
            continue
        # Slices of one owner, consecutive in the bucket, travel as one (DeepSpeed merges them).
        slices: list[list[Piece]] = []
        for g, start, end in bucket:
            shard = groups[g][1]
            while start < end:
                owner, cut = start // shard, min(end, (start // shard + 1) * shard)
                if slices and slices[-1][-1].owner == owner:
                    slices[-1].append(Piece(g, start, cut, owner))
                else:
                    slices.append([Piece(g, start, cut, owner)])
                start = cut
        scaling = "divide_first" if average else "none"
        if zero.use_multi_rank_bucket_allreduce:
            calls += [Call("all_reduce", c, scaling=scaling) for c in _chunks(slices, size)]
            continue
        for dst in dict.fromkeys(s[0].owner for s in slices):  # owners in order of appearance
            mine = [s for s in slices if s[0].owner == dst]
            calls += [Call("reduce", c, dst, scaling) for c in _chunks(mine, size)]
    return calls


def round_robin(numels: list[int], world_size: int) -> list[int]:
    """DeepSpeed's ``round_robin_gradients`` order of a group's parameters in the flat vector:
    parameter i goes to list i mod W, and the lists are laid end to end."""
    return [i for r in range(world_size) for i in range(r, len(numels), world_size)]


def scale_steps(
    scaling: str, world_size: int, average: bool, prescale: bool, predivide: float
) -> tuple[Callable | None, Callable | None]:
    """(before, after): what is done to the buffer before and after the sum, in DeepSpeed's
    operation order (``engine``: stage 0's; ``predivide``: stage 1 with reduce_scatter false)."""
    w = world_size
    if not average or scaling == "none":
        return None, None
    if scaling == "divide_first":
        return (lambda t: t.div_(w / 1.0)), None
    if prescale:
        return (
            (lambda t: t.mul_(1.0 / w)) if scaling == "engine" else (lambda t: t.div_(w / 1.0))
        ), None
    before = (lambda t: t.mul_(1.0 / predivide)) if predivide != 1.0 else None
    after = (lambda t: t.mul_(predivide / w)) if predivide != w else None
    return before, after


def reduce_views(
    views: list[torch.Tensor],
    group,
    comm_dtype,
    kind: str = "all_reduce",
    dst: int | None = None,
    steps=(None, None),
) -> None:
    """One collective over ``views`` (flattened together, in ``comm_dtype``), written back.

    With ``reduce`` only ``dst`` receives the sum (the others' views keep what they had)."""
    if group is None or not views:
        return
    flat = torch.cat([v.reshape(-1) for v in views])
    flat = flat.to(comm_dtype) if comm_dtype is not None else flat
    before, after = steps
    if before is not None:
        before(flat)
    if kind == "all_reduce":
        dist.all_reduce(flat, group=group)
    else:
        dist.reduce(flat, dist.get_global_rank(group, dst), group=group)
        if dist.get_rank(group) != dst:
            return
    if after is not None:
        after(flat)
    offset = 0
    for v in views:
        v.copy_(flat[offset : offset + v.numel()].view_as(v))
        offset += v.numel()


@dataclass(frozen=True)
class Division:
    """Where DeepSpeed divides the sum by the world size: the config's
    ``gradient_allreduce_op`` (``"sum"``: not at all), ``prescale_gradients`` and
    ``gradient_predivide_factor``."""

    average: bool = True
    prescale: bool = False
    predivide: float = 1.0

    @classmethod
    def of(cls, config) -> Division:
        return cls(
            config.gradient_allreduce_op == "mean",
            config.prescale_gradients,
            config.gradient_predivide_factor,
        )

    def steps(self, scaling: str, world_size: int):
        """:func:`scale_steps` for a collective of ``scaling``."""
        return scale_steps(scaling, world_size, self.average, self.prescale, self.predivide)


@dataclass(frozen=True)
class Zero1Plan:
    """DeepSpeed 0.19.8's ZeRO-1 boundary, as its config decides it: the collectives that
    reduce the flat gradients (:meth:`reduce`), the order of the parameters in the flat vector
    (:meth:`order`, ``round_robin_gradients``) and whether every update computes the global
    norm (``compute_grad_norm``, which only matters with clipping off)."""

    zero: Any  # the config's zero_optimization
    division: Division
    engine_buckets: bool  # BF16_Optimizer (bf16 + fp32 accumulation): stage 0's buckets

    @classmethod
    def of(cls, config, route) -> Zero1Plan:
        return cls(config.zero_optimization, Division.of(config), route.wrapper == "BF16_Optimizer")

    @property
    def compute_norm(self) -> bool:
        return self.zero.compute_grad_norm

    def order(self, numels: list[int], world_size: int) -> list[int]:
        if self.zero.round_robin_gradients:
            return round_robin(numels, world_size)
        return list(range(len(numels)))

    def reduce(self, flats: list[torch.Tensor], groups, group, comm_dtype) -> None:
        """Reduce each param group's flat local gradient (``flats``) in place, with
        DeepSpeed's collectives; ``groups`` are ZeRO-1's flat groups (their layout)."""
        if self.engine_buckets:  # no ZeRO buckets: the engine's
            real = [t[: g.layout.numel] for g, t in zip(groups, flats, strict=True)]
            engine_all_reduce(real, group, self.division, comm_dtype)
            return
        world = dist.get_world_size(group) if group is not None else 1
        for call in stage1_calls([(g.walk, g.layout.shard_size) for g in groups], self.zero):
            views = [flats[p.group][p.start : p.end] for p in call.pieces]
            steps = self.division.steps(call.scaling, world)
            reduce_views(views, group, comm_dtype, call.kind, call.dst, steps)


def engine_all_reduce(grads: list[torch.Tensor], group, division: Division, comm_dtype) -> None:
    """Stage 0's reduction (and BF16_Optimizer's at stage 1): 5e8-element buckets, in place."""
    if group is None:
        return
    steps = division.steps("engine", dist.get_world_size(group))
    by_dtype: dict[torch.dtype, list] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        bucket, size = [], 0
        for g in same:  # DeepSpeed closes a bucket once it exceeds the size
            bucket.append(g)
            size += g.numel()
            if size > STAGE0_BUCKET_ELEMENTS:
                reduce_views(bucket, group, comm_dtype, steps=steps)
                bucket, size = [], 0
        reduce_views(bucket, group, comm_dtype, steps=steps)
