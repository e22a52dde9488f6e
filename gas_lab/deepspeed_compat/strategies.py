"""How the weights change at the accumulation boundary: one strategy per ZeRO stage.

The engine (:mod:`gas_lab.engine`) decides *when* the boundary is; a strategy decides *how*
gradients are reduced and the optimizer steps there. Every strategy has the same two methods
(:class:`UpdateStrategy`), so the engine's counting logic never changes from stage to stage:

* stage 0, :class:`AllReduceUpdate` (below): every rank holds everything and all-reduces
  the whole gradient;
* stage 1, :class:`gas_lab.zero1.ShardedUpdate`: each rank keeps the optimizer state of one
  shard;
* stage 2, :class:`gas_lab.zero2.PartitionedGradientUpdate`: each rank keeps the gradient of its
  shard only, so gradients are reduced in every ``backward()`` (the engine calls the optional
  ``after_backward()`` of a strategy at the end of each one; lesson 09).

:func:`strategy_for` is the stage -> strategy choice ``gas_lab.initialize`` makes; pass
``initialize(..., strategy=...)`` to choose yourself (lesson 05 compares two reductions).
"""

from __future__ import annotations

import functools
import math
from typing import Protocol

import torch

from gas_lab.deepspeed_compat import buckets, precision
from gas_lab.dp import clip_by_norm, replicated_grad_norm
from gas_lab.zero1 import REDUCE_MODES, ShardedUpdate
from gas_lab.zero2 import PartitionedGradientUpdate


class UpdateStrategy(Protocol):
    """What the engine needs from a "reduce gradients, then update" implementation.

    Built as ``Strategy(params, optimizer, group, config)``; ``params`` are the module's
    parameters, ``group`` the data-parallel process group (None: a single process).
    """

    optimizer: torch.optim.Optimizer

    def reduce_gradients(self) -> None:
        """Make every rank hold the gradient averaged over ranks (called at the boundary)."""

    def update(self) -> bool:
        """Clip, step the optimizer, clear the gradients; return whether weights changed
        (False: a skipped update, e.g. a non-finite gradient norm in bf16)."""

    def state_dict(self) -> dict:
        """This rank's optimizer state, fp32 master weights included (for checkpoints)."""

    def load_state_dict(self, state: dict, load_optimizer_states: bool = True) -> None:
        """Restore :meth:`state_dict`, after the module's weights were loaded."""


class AllReduceUpdate:
    """ZeRO stage 0: every rank keeps all the weights and the whole optimizer state.

    ``reduce_gradients()`` averages the gradients over ranks, one all-reduce per bucket
    (:func:`gas_lab.deepspeed_compat.buckets.engine_all_reduce`, with DeepSpeed's ``prescale_gradients`` and
    ``gradient_predivide_factor``);
    ``update()`` clips, steps the optimizer and clears the gradients, identically on every rank,
    which keeps the replicas equal. Shaped like DeepSpeed's: gradients reduced in large buckets,
    then clipped by their global norm, then one optimizer step.

    With bf16 (lesson 08) the model keeps bf16 weights and ``.grad``; the optimizer steps on
    fp32 masters, and an update whose gradient norm is not finite is skipped: DeepSpeed's
    ``FP16_UnfusedOptimizer``. ``"gradient_allreduce_op": "sum"`` drops the division.
    """

    def __init__(self, params, optimizer, group, config):
        # Frozen and empty parameters have nothing to reduce (DeepSpeed skips them too).
        self.params = [p for p in params if p.requires_grad and p.numel() > 0]
        self.optimizer = optimizer
        self.group = group
        self.max_norm = config.gradient_clipping
        self.config = config
        self.precision = precision.route(config)
        self.masters = None  # fp32 copies the optimizer steps on, for a bf16 model
        if self.precision.fp32_master:
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
            if p.grad is None:
                # A parameter unused on this rank still joins the collective: every rank must
                # reduce buffers of the same layout, or the all-reduce mixes up tensors.
                p.grad = torch.zeros_like(p)
        # DeepSpeed's buckets of 5e8 elements, with its pre/post division (gas_lab/deepspeed_compat/buckets.py).
        grads = [p.grad for p in self.params]
        buckets.engine_all_reduce(grads, self.group, self.config, self.precision.communicate)

    def update(self) -> bool:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if self.masters is None:  # fp32: no overflow check at stage 0, as in DeepSpeed
            if self.max_norm > 0:
                clip_by_norm(grads, replicated_grad_norm(grads, self.group), self.max_norm)
            self.optimizer.step()
            self._clear()
            return True
        # FP16_UnfusedOptimizer's norm: squares summed in fp32, the root in float64, no
        # collective (the reduced gradient is the same on every rank).
        norm = float(sum(g.float().norm() ** 2 for g in grads)) ** 0.5
        if not math.isfinite(norm):  # inf/nan somewhere: skip, weights untouched
            self._clear()
            return False
        for master, g in zip(self.masters, grads, strict=True):
            master.grad = g.float()  # exact: every bf16 value is an fp32 value
        if self.max_norm > 0:
            clip_by_norm([m.grad for m in self.masters], norm, self.max_norm)
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

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "masters": self.masters}

    def load_state_dict(self, state: dict, load_optimizer_states: bool = True) -> None:
        if load_optimizer_states:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.masters is not None:
            # The saved fp32 masters when the optimizer state is loaded (exact), else the
            # loaded bf16 weights (rounded), as DeepSpeed does.
            saved = state["masters"] if load_optimizer_states else self.params
            with torch.no_grad():
                for master, value in zip(self.masters, saved, strict=True):
                    master.copy_(value)


def strategy_for(stage: int, reduce: str | None = None):
    """The strategy class for a ZeRO stage: 0 -> :class:`AllReduceUpdate`, 1 ->
    :class:`~gas_lab.zero1.ShardedUpdate`, whose gradient reduction ``reduce`` picks (None or
    ``"deepspeed"``: DeepSpeed's, as the config's ``zero_optimization`` keys say; lesson 05's
    variants ``"all_reduce"`` and ``"reduce_scatter"``), 2 ->
    :class:`~gas_lab.zero2.PartitionedGradientUpdate`."""
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
    if stage == 2:
        if reduce is not None:
            raise ValueError("reduce= chooses ZeRO-1's reduction; stage 2 reduces in backward()")
        return PartitionedGradientUpdate
    # Stage 3 never gets here: initialize refuses it as out of scope first.
    raise ValueError(f"no gas_lab strategy for ZeRO stage {stage}")
