"""Managed and unmanaged accumulation: the engine lessons 03 and 04 build, in DeepSpeed's names.

The loop calls ``backward()`` and ``step()``; the engine decides where the **accumulation
boundary** is, the micro-batch after which the gradients are reduced over ranks and the weights
change. *How* they are reduced and updated is a strategy's: :class:`AllReduce` below (ZeRO stage
0), :class:`gas_lab.zero1.ShardedUpdate` (lesson 05), :class:`gas_lab.zero2.PartitionedGradientUpdate`.

* **managed** (lesson 03, :class:`ManagedEngine`): ``step()`` counts its calls in
  ``micro_steps``; the boundary is the call for which :func:`is_boundary` holds. Its
  ``backward()`` reduces (unless inside ``no_sync()``) and its ``step()`` updates; every other
  ``step()`` only counts.
* **unmanaged** (lesson 04, :class:`Engine` adds it): every ``step()`` is the boundary: it
  reduces what the ``backward()`` calls since the last one accumulated, then updates once,
  however many there were.

The idea alone: :func:`gas_lab.initialize` returns
:class:`~gas_lab.deepspeed_compat.engine.DeepSpeedEngine`, :class:`Engine` plus what DeepSpeed does
around it (config, refusals, precision, schedules, checkpoints).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from gas_lab.dp import all_reduce_mean, broadcast_parameters, clip_by_norm, global_norm


def is_boundary(micro_steps: int, gas: int) -> bool:
    """Managed accumulation's one rule: does the coming ``step()`` end a window? Asked before it
    adds 1 to ``micro_steps``, so the gas-th, 2·gas-th, ... calls say yes."""
    return (micro_steps + 1) % gas == 0


def samples_run(micro_batches: int, micro_batch_size: int, world_size: int) -> int:
    """Unmanaged: the samples one update consumed, counted from this rank's ``backward()``
    calls (exact when every rank ran as many; lesson 04 shows what it says when not)."""
    return micro_batches * micro_batch_size * world_size


@runtime_checkable
class Strategy(Protocol):
    """How the boundary reduces and updates: everything an engine calls on its strategy.
    :class:`AllReduce` (stage 0), :class:`gas_lab.zero1.ShardedUpdate` (lesson 05) and
    :class:`gas_lab.zero2.PartitionedGradientUpdate` (lesson 09) are the floor's; DeepSpeed's
    engine calls a few more (:class:`gas_lab.deepspeed_compat.strategies.DeepSpeedStrategy`).
    Built by ``strategy(params, optimizer, group, max_norm)``."""

    optimizer: torch.optim.Optimizer  # the one that steps (ZeRO: over this rank's shard)

    def after_backward(self) -> None:
        """A backward pass ended (ZeRO-2 reduces its last bucket; the others do nothing)."""

    def reduce_gradients(self) -> None:
        """The boundary: average the gradients over ranks."""

    def update(self) -> bool:
        """Clip, step, clear the gradients. True: the weights changed (False: skipped)."""


class AllReduce:
    """ZeRO stage 0: every rank keeps all the weights and the whole optimizer state, and runs
    the same update on the same averaged gradient, which keeps the replicas equal."""

    def __init__(self, params, optimizer, group=None, max_norm: float = 0.0):
        self.params = [p for p in params if p.requires_grad]
        self.optimizer, self.group, self.max_norm = optimizer, group, max_norm

    def after_backward(self) -> None:
        """Nothing: stage 0 reduces at the boundary only (ZeRO-2 reduces in every backward)."""

    def reduce_gradients(self) -> None:
        """Average the gradients over ranks, in one all-reduce (lesson 02)."""
        for p in self.params:
            if p.grad is None:  # unused here, still reduced: every rank sends the same layout
                p.grad = torch.zeros_like(p)
        all_reduce_mean([p.grad for p in self.params], self.group)

    def update(self) -> bool:
        """Clip by the global norm, step, clear the gradients; True: the weights changed."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.max_norm > 0 and grads:
            clip_by_norm(grads, self.grad_norm(grads), self.max_norm)
        self.optimizer.step()
        for p in self.params:
            p.grad = None  # the next window accumulates from zero
        return True

    def grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Every rank holds the whole averaged gradient: its norm needs no collective."""
        return global_norm(grads)


class ManagedEngine(torch.nn.Module):
    """Managed accumulation (lesson 03): wraps a module, counts micro-steps; at the boundary,
    the strategy reduces the gradients over ranks (``reduce_gradients()``), then updates the
    weights (``update()``).

    ``strategy(params, optimizer, group, max_norm)`` builds it (:class:`AllReduce`, or ZeRO's);
    ``group`` is the data-parallel process group (None: one process, no collectives).
    """

    def __init__(
        self,
        module,
        optimizer,
        gas: int,
        micro_batch_size: int,
        group=None,
        strategy: Callable[..., Strategy] = AllReduce,
        max_norm: float = 0.0,
    ):
        super().__init__()
        broadcast_parameters(module, group)  # every rank starts from rank 0's weights
        self.module, self.group = module, group
        self.strategy: Strategy = strategy(list(module.parameters()), optimizer, group, max_norm)
        self.optimizer = self.strategy.optimizer  # ZeRO re-points it at this rank's shard
        self.gas, self.micro_batch_size = gas, micro_batch_size
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.micro_steps = 0  # step() calls so far, boundary or not
        self.global_steps = 0  # updates so far
        self.global_samples = 0  # samples (all ranks) consumed by those updates
        self.inside_no_sync_ctxt = False  # inside no_sync(): backward() does not reduce

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        """Add the gradient of ``loss`` into ``.grad`` (divided by GAS unless told not to)."""
        if scale_wrt_gas:
            # Gradients add up over micro-batches: dividing each loss by GAS turns the sum of
            # GAS micro-batch means into the mean over the window.
            loss = loss / self.gas
        loss.backward(retain_graph=retain_graph)
        self.after_backward()
        return loss

    def after_backward(self) -> None:
        """The end of a backward pass: the boundary micro-batch reduces now."""
        if self.reduces_now():
            self.strategy.reduce_gradients()

    def reduces_now(self) -> bool:
        """At the boundary and not inside ``no_sync()``: the gradients are reduced here."""
        return self.is_gradient_accumulation_boundary() and not self.inside_no_sync_ctxt

    def step(self) -> None:
        """Update at the boundary only; every call counts."""
        if self.is_gradient_accumulation_boundary():
            self.update()
        self.micro_steps += 1

    def update(self) -> bool:
        """The boundary's update, and the counters; they advance even when the strategy
        skipped it (a non-finite gradient norm), as DeepSpeed's do. True: the weights changed."""
        applied = self.strategy.update()
        self.global_steps += 1
        self.global_samples += self.samples_per_update()
        return applied

    def samples_per_update(self) -> int:
        return self.gas * self.micro_batch_size * self.world_size

    def is_gradient_accumulation_boundary(self) -> bool:
        """The counter decides (:func:`is_boundary`)."""
        return is_boundary(self.micro_steps, self.gas)

    @contextlib.contextmanager
    def no_sync(self):
        """Inside the block ``backward()`` keeps its gradients local, even at the boundary."""
        self.inside_no_sync_ctxt = True
        try:
            yield
        finally:
            self.inside_no_sync_ctxt = False


class Engine(ManagedEngine):
    """:class:`ManagedEngine`, or with ``managed=False`` unmanaged accumulation (lesson 04);
    and a strategy that reduces during every backward (ZeRO-2, lesson 09) hears of its end.

    One engine in two classes so that lesson 03 prints the managed half and lesson 04 only what
    unmanaged changes; gas_lab builds only this one. An unmanaged ``step()`` reads across both:
    :meth:`step` opens the boundary (``inside_step``) and reduces, :meth:`ManagedEngine.step`
    updates (:meth:`ManagedEngine.update`, then :meth:`update` here resets ``backward_calls``)
    and counts the micro-step, and :meth:`step` closes the boundary.
    """

    def __init__(self, module, optimizer, gas: int, micro_batch_size: int, managed=True, **kw):
        super().__init__(module, optimizer, gas, micro_batch_size, **kw)  # group, strategy, ...
        self.managed = managed
        self.backward_calls = 0  # since the last update: unmanaged, what global_samples counts
        self.inside_step = False  # unmanaged, the boundary is "inside step()"

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        loss = super().backward(loss, retain_graph, scale_wrt_gas)
        self.backward_calls += 1
        return loss

    def after_backward(self) -> None:
        self.strategy.after_backward()  # ZeRO-2 reduces its last bucket (lesson 09)
        super().after_backward()  # unmanaged, no backward() is a boundary: nothing reduces

    def step(self) -> None:
        """Unmanaged: every call is the boundary: reduce what the ``backward()`` calls since
        the last update accumulated, then update."""
        if self.managed:
            return super().step()
        self.inside_step = True
        self.strategy.reduce_gradients()
        super().step()
        self.inside_step = False

    def samples_per_update(self) -> int:
        if self.managed:
            return super().samples_per_update()
        # The caller chose how many micro-batches went into this update.
        return samples_run(self.backward_calls, self.micro_batch_size, self.world_size)

    def update(self) -> bool:
        applied = super().update()
        self.backward_calls = 0
        return applied

    def is_gradient_accumulation_boundary(self) -> bool:
        """Managed: the counter decides (:func:`is_boundary`). Unmanaged: only ``step()`` is."""
        if not self.managed:
            return self.inside_step
        return super().is_gradient_accumulation_boundary()
