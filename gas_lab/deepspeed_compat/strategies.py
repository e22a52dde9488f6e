"""The strategy for each ZeRO stage, built as DeepSpeed 0.19.8 runs it: its buckets, its
precision, its norm.

The floor's strategies (:class:`gas_lab.engine.AllReduce`, :class:`gas_lab.zero1.ShardedUpdate`,
:class:`gas_lab.zero2.PartitionedGradientUpdate`) reduce and update from scratch. Here the config
decides what their DeepSpeed versions are given: the bucket plan (:mod:`.buckets`) and the
precision (:mod:`.precision`) for :class:`~.zero.Zero1`, the bucket size for
:class:`~.zero.Zero2`; stage 0 gets DeepSpeed's own flavour, :class:`AllReduceUpdate`
(5e8-element buckets, the division before or after the sum, the norm's all-reduce, fp32
masters for a bf16 model). At ZeRO-1 each
parameter also carries what ``deepspeed.utils.safe_get_full_grad`` reads
(:func:`expose_full_gradients`).

:func:`strategy_for` is the stage -> strategy choice ``gas_lab.initialize`` makes; pass
``initialize(..., strategy=strategy_for(1, reduce=...))`` for lesson 05's textbook reductions.
"""

from __future__ import annotations

import functools
import math
import types
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from gas_lab.deepspeed_compat import buckets, precision
from gas_lab.deepspeed_compat.norms import clip_by_float_norm, replicated_grad_norm
from gas_lab.deepspeed_compat.zero import Zero1, Zero2
from gas_lab.engine import AllReduce, Strategy
from gas_lab.zero1 import REDUCE_MODES


@runtime_checkable
class DeepSpeedStrategy(Strategy, Protocol):
    """Everything :class:`~gas_lab.deepspeed_compat.engine.DeepSpeedEngine` calls on its
    strategy: the floor's three (:class:`gas_lab.engine.Strategy`) and these. Every stage's
    strategy here has them all (:class:`AllReduceUpdate`, :class:`~.zero.Zero1`,
    :class:`~.zero.Zero2`), a no-op where its stage has nothing to do."""

    last_norm: float | None  # the last update's gradient norm; None where DeepSpeed keeps none

    def before_backward(self) -> None:
        """A backward pass starts (ZeRO-1, bf16 with fp32 accumulation: a fresh ``.grad``)."""

    def defer_reduction(self, deferred: bool) -> None:
        """``coalesce_grad_reduction()``: while True, keep gradients local (ZeRO-2 would
        reduce them inside ``backward()``)."""

    def destroy(self) -> None:
        """``engine.destroy()``: take off what the strategy attached to the parameters."""


class AllReduceUpdate(AllReduce):
    """ZeRO stage 0 as DeepSpeed runs it: :class:`gas_lab.engine.AllReduce`, with the gradients
    reduced in DeepSpeed's buckets (:func:`gas_lab.deepspeed_compat.buckets.engine_all_reduce`:
    ``prescale_gradients``, ``gradient_predivide_factor``, ``"gradient_allreduce_op": "sum"``,
    ``communication_data_type``).

    With bf16 (lesson 08) the model keeps bf16 weights and ``.grad``; the optimizer steps on
    fp32 masters, and an update whose gradient norm is not finite is skipped: DeepSpeed's
    ``FP16_UnfusedOptimizer``.
    """

    last_norm = None  # DeepSpeed's stage 0 keeps no global gradient norm

    def before_backward(self) -> None:
        """Nothing: ``.grad`` accumulates in the model's dtype at stage 0."""

    def defer_reduction(self, deferred: bool) -> None:
        """Nothing: stage 0 reduces at the boundary only (and refuses coalescing)."""

    def destroy(self) -> None:
        """Nothing: stage 0 attaches nothing to the parameters."""

    def __init__(
        self,
        params,
        optimizer,
        group,
        max_norm,
        division: buckets.Division,
        route: precision.Precision,
    ):
        # Frozen and empty parameters have nothing to reduce (DeepSpeed skips them too).
        super().__init__([p for p in params if p.numel() > 0], optimizer, group, max_norm)
        self.division, self.precision = division, route
        self.masters = None  # fp32 copies the optimizer steps on, for a bf16 model
        if route.fp32_master:
            self.masters = precision.fp32_masters(self.params, optimizer)
            # DeepSpeed's FP16_UnfusedOptimizer creates the optimizer state by stepping once
            # on zero gradients while it is built: Adam's step count starts at 1 (its bias
            # correction differs from then on) and AdamW's weight decay hits the masters once.
            for master in self.masters:
                master.grad = torch.zeros_like(master)
            optimizer.step()
            for master in self.masters:
                master.grad = None

    def reduce_gradients(self) -> None:
        for p in self.params:
            if p.grad is None:  # every rank reduces buffers of the same layout
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.params]
        buckets.engine_all_reduce(grads, self.group, self.division, self.precision.communicate)

    def grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        return replicated_grad_norm(grads, self.group)  # with DeepSpeed's all-reduce

    def update(self) -> bool:
        if self.masters is None:  # fp32: no overflow check at stage 0, as in DeepSpeed
            return super().update()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        # FP16_UnfusedOptimizer's norm: squares summed in fp32, the root in float64, no
        # collective (the reduced gradient is the same on every rank).
        norm = float(sum(g.float().norm() ** 2 for g in grads)) ** 0.5
        if not math.isfinite(norm):  # inf/nan somewhere: skip, weights untouched
            self._clear()
            return False
        for master, g in zip(self.masters, grads, strict=True):
            master.grad = g.float()  # exact: every bf16 value is an fp32 value
        if self.max_norm > 0:
            clip_by_float_norm([m.grad for m in self.masters], norm, self.max_norm)
        self.optimizer.step()
        with torch.no_grad():
            for p, master in zip(self.params, self.masters, strict=True):
                p.copy_(master)  # round the new fp32 weights to bf16
                master.grad = None
        self._clear()
        return True

    def _clear(self) -> None:
        for p in self.params:
            p.grad = None  # the next step accumulates from scratch


def zero1(params, optimizer, group, max_norm, config, reduce: str | None = None):
    """ZeRO-1 with DeepSpeed's bucket plan and precision (``reduce``: one of lesson 05's
    textbook reductions instead of DeepSpeed's buckets, in the plain layout)."""
    route = precision.route(config)
    plan = None if reduce is not None else buckets.Zero1Plan.of(config, route)
    strategy = Zero1(
        params,
        optimizer,
        group,
        max_norm,
        reduce or "all_reduce",
        average=config.gradient_allreduce_op == "mean",
        plan=plan,
        precision=route,
    )
    expose_full_gradients(strategy)
    return strategy


def zero2(params, optimizer, group, max_norm, config):
    """ZeRO-2 in DeepSpeed's default reduction (fp32 only: the rules refuse the rest)."""
    return Zero2(
        params,
        optimizer,
        group,
        max_norm,
        config.zero_optimization.reduce_bucket_size,
        average=config.gradient_allreduce_op == "mean",
    )


def stage0(params, optimizer, group, max_norm, config):
    return AllReduceUpdate(
        params, optimizer, group, max_norm, buckets.Division.of(config), precision.route(config)
    )


def strategy_for(stage: int, reduce: str | None = None):
    """What builds the strategy for a ZeRO stage from the config: ``f(params, optimizer, group,
    max_norm, config)``. Stage 0: :class:`AllReduceUpdate`; 1: :class:`~.zero.Zero1` with
    DeepSpeed's plan, or lesson 05's ``reduce`` (``"all_reduce"``, ``"reduce_scatter"``);
    2: :class:`~.zero.Zero2`."""
    if reduce is not None and stage != 1:
        raise ValueError(f"reduce= chooses ZeRO-1's reduction; stage {stage} has one reduction")
    if stage == 0:
        return stage0
    if stage == 1:
        if reduce is not None and reduce not in REDUCE_MODES:
            raise ValueError(f"reduce must be one of {REDUCE_MODES}, got {reduce!r}")
        return functools.partial(zero1, reduce=reduce)
    if stage == 2:
        return zero2
    # Stage 3 never gets here: initialize refuses it as out of scope first.
    raise ValueError(f"no gas_lab strategy for ZeRO stage {stage}")


# -- DeepSpeed's view of ZeRO-1's shards ------------------------------------------------------
def expose_full_gradients(strategy: Zero1) -> None:
    """Give each parameter the two attributes ``deepspeed.utils.safe_get_full_grad(param)``
    looks for, so code that reads gradients the DeepSpeed way reads gas_lab's ZeRO-1 too;
    :meth:`~.zero.Zero1.destroy` (``engine.destroy()``) takes them off again."""
    for g in strategy.groups:
        # params and offsets in the flat vector's order (round_robin_gradients reorders)
        for p, offset in zip(g.params, g.layout.offsets, strict=True):
            p._hp_mapping = (strategy.group, g, offset)
            p.get_full_hp_grad = types.MethodType(full_gradient, p)


def full_gradient(param: torch.nn.Parameter) -> torch.Tensor:
    """The rank-averaged fp32 gradient of ``param`` while it exists only as shards: from the
    boundary's reduction until the update (afterwards: ValueError, as in DeepSpeed).

    A collective: every rank calls it for the same parameters in the same order. Each rank
    writes the part of ``param`` its shard holds into zeros; one all-reduce (a sum) puts the
    parts together, as DeepSpeed's ``get_full_hp_grad`` does.
    """
    group, g, offset = param._hp_mapping
    if g.grad_shard is None:
        raise ValueError(
            "Gradients are only available immediately after backward and before engine step"
        )
    n = param.numel()
    full = torch.zeros(n, dtype=torch.float32, device=g.flat.device)
    lo, hi = max(offset, g.start), min(offset + n, g.end)  # this rank's part of param
    if lo < hi:
        full[lo - offset : hi - offset] = g.grad_shard[lo - g.start : hi - g.start]
    if group is not None:
        dist.all_reduce(full, group=group)
    return full.view_as(param)
