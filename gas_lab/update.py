"""How the weights change at the accumulation boundary: one strategy per ZeRO stage.

The engine (:mod:`gas_lab.engine`) decides *when* the boundary is; a strategy decides *how*
gradients are reduced and the optimizer steps there. Every strategy has the same two methods
(:class:`UpdateStrategy`), so the engine's counting logic never changes from stage to stage:

* stage 0, :class:`AllReduceUpdate` (below): every rank holds everything and all-reduces
  the whole gradient;
* stage 1, :class:`gas_lab.zero1.ShardedUpdate`: each rank keeps the optimizer state of one
  shard.

:func:`strategy_for` is the stage -> strategy choice ``gas_lab.initialize`` makes; pass
``initialize(..., strategy=...)`` to choose yourself (lesson 05 compares two reductions).
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch

from gas_lab.dp import all_reduce_mean, clip_by_norm, replicated_grad_norm
from gas_lab.zero1 import REDUCE_MODES, ShardedUpdate

# DeepSpeed's stage-0 bucket, in elements: a small model's gradients fit in one all-reduce.
ALLREDUCE_BUCKET_ELEMENTS = 500_000_000


class UpdateStrategy(Protocol):
    """What the engine needs from a "reduce gradients, then update" implementation.

    Built as ``Strategy(params, optimizer, group, config)``; ``params`` are the module's
    parameters, ``group`` the data-parallel process group (None: a single process).
    """

    optimizer: torch.optim.Optimizer

    def reduce_gradients(self) -> None:
        """Make every rank hold the gradient averaged over ranks (called at the boundary)."""

    def update(self) -> bool:
        """Clip, step the optimizer, clear the gradients; return whether weights changed."""


class AllReduceUpdate:
    """ZeRO stage 0: every rank keeps all the weights and the whole optimizer state.

    ``reduce_gradients()`` averages the gradients over ranks, one all-reduce per bucket;
    ``update()`` clips, steps the optimizer and clears the gradients, identically on every rank,
    which keeps the replicas equal. Shaped like DeepSpeed's: gradients reduced in large buckets,
    then clipped by their global norm, then one optimizer step.
    """

    def __init__(self, params, optimizer, group, config):
        # Frozen and empty parameters have nothing to reduce (DeepSpeed skips them too).
        self.params = [p for p in params if p.requires_grad and p.numel() > 0]
        self.optimizer = optimizer
        self.group = group
        self.max_norm = config.gradient_clipping

    def reduce_gradients(self) -> None:
        for p in self.params:
            if p.grad is None:
                # A parameter unused on this rank still joins the collective: every rank must
                # reduce buffers of the same layout, or the all-reduce mixes up tensors.
                p.grad = torch.zeros_like(p)
        for bucket in _buckets([p.grad for p in self.params], ALLREDUCE_BUCKET_ELEMENTS):
            all_reduce_mean(bucket, self.group)

    def update(self) -> bool:
        if self.max_norm > 0:
            grads = [p.grad for p in self.params]
            clip_by_norm(grads, replicated_grad_norm(grads, self.group), self.max_norm)
        self.optimizer.step()
        for p in self.params:
            p.grad = None  # the next step accumulates from scratch
        return True


def _buckets(grads, max_elements):
    """Group gradients by dtype, then into buckets that close once they exceed max_elements."""
    by_dtype: dict[torch.dtype, list] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same_dtype in by_dtype.values():
        bucket, size = [], 0
        for g in same_dtype:
            bucket.append(g)
            size += g.numel()
            if size > max_elements:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket


def strategy_for(stage: int, reduce: str | None = None):
    """The strategy class for a ZeRO stage: 0 -> :class:`AllReduceUpdate`, 1 ->
    :class:`~gas_lab.zero1.ShardedUpdate`, whose gradient reduction ``reduce`` picks
    (``"all_reduce"`` or ``"reduce_scatter"``; None: DeepSpeed's choice)."""
    if stage == 0:
        if reduce is not None:
            raise ValueError("reduce= chooses ZeRO-1's reduction; stage 0 always all-reduces")
        return AllReduceUpdate
    if stage == 1:
        if reduce is None:
            return ShardedUpdate
        if reduce not in REDUCE_MODES:
            raise ValueError(f"reduce must be one of {REDUCE_MODES}, got {reduce!r}")
        return functools.partial(ShardedUpdate, reduce=reduce)
    # Stages 2/3 never get here: initialize refuses them as out of scope first.
    raise ValueError(f"no gas_lab strategy for ZeRO stage {stage}")
