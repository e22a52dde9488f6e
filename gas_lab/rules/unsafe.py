"""UNSAFE TEACHING MODE: switch a rule off and measure the silent failure it prevents.

Never train with this. Lesson 06 uses it to show *why* each refusal in :mod:`gas_lab.rules.refusals`
exists: with the check skipped, the run completes without an error, and only a measurement
(ranks drifting apart, distance from the reference, a count of all-reduces) shows the damage.

:func:`initialize` builds gas_lab's engine with the named rules skipped, plus the
boundary-gated work DeepSpeed would do for the feature the rule was guarding:

* ``overlap_comm`` at ZeRO >= 1 reduces *inside backward()*, and only in the backward() of the
  boundary micro-batch; step() then trusts that it did.
* ``DeepCompile`` is modelled from DeepSpeed's source (its CPU accelerator has no DeepCompile
  op, so it cannot run here): at stage 0
  DeepSpeed falls back to plain torch.compile, which changes nothing here; at ZeRO-1 every
  backward() that is not the boundary empties the optimizer's averaged gradients
  (``deepspeed/compile/init_z1_and_2.py``), so step() finds none and raises ``KeyError``.
* Apex ``amp`` multiplies the loss by a loss scale and divides the gradients by it again only
  in the backward() of the boundary micro-batch (``delay_unscale`` on all the others).
* like DeepSpeed's engine, step() reduces only at a boundary and never inside ``no_sync()``.
* a direct ``loss.backward()`` at stage 0 is divided by GAS by the output hook, but nothing
  sees it end, so its boundary reduction never runs (DeepSpeed has no hook for it there).

Unmanaged, no backward() is a boundary, so each of these quietly never happens.
:func:`deepspeed_initialize` (and :func:`allow_tensor_backward`) do the same to *real*
DeepSpeed, so the lesson can check that this model of the failure matches what DeepSpeed itself
would have done.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
import torch.distributed as dist

from gas_lab.deepspeed_compat.config import load_config
from gas_lab.deepspeed_compat.engine import DeepSpeedEngine
from gas_lab.deepspeed_compat.strategies import strategy_for
from gas_lab.dp import default_group
from gas_lab.rules import refusals

BANNER = "UNSAFE TEACHING MODE: rules skipped: {}. Never train with this engine."
# Skipping a rule about a feature gas_lab leaves out also lets that feature past scope checks.
_ALSO_SKIP = {"unmanaged_deepcompile": {"deepcompile"}}


class GatedReduction:
    """Wraps the engine's update strategy: decides whether a reduction really happens."""

    def __init__(self, inner, engine: UnsafeEngine):
        self.inner, self.engine = inner, engine
        self.optimizer = inner.optimizer
        self.done = self.skipped = 0  # reductions run / reductions a feature swallowed

    def after_backward(self) -> None:
        self.inner.after_backward()

    def reduce_gradients(self) -> None:
        e = self.engine
        if e.inside_step:  # unmanaged step(): DeepSpeed reduces only at a boundary, outside
            # no_sync(), and not at all when a feature owns the reduction inside backward()
            wanted = e.is_gradient_accumulation_boundary() and not e.inside_no_sync_ctxt
            if not wanted or e.reduces_in_backward_only:
                self.skipped += 1
                return
        self.done += 1
        self.inner.reduce_gradients()

    def update(self) -> bool:
        return self.inner.update()


class UnsafeEngine(DeepSpeedEngine):
    """gas_lab's engine with ``skipped`` rules off (through its one :meth:`check`) and the
    skipped features' backward() work."""

    def __init__(self, module, optimizer, config, group, strategy, skipped, loss_scale):
        super().__init__(module, optimizer, config, group, strategy)
        self.skipped = frozenset(skipped)
        zero = config.zero_optimization
        # At stage 0 DeepSpeed ignores overlap_comm (there is no ZeRO optimizer to overlap).
        self.reduces_in_backward_only = zero.overlap and zero.stage >= 1
        # DeepCompile is active at ZeRO 1-3 only; at ZeRO-1 only a boundary backward() leaves
        # averaged gradients for step() (a non-boundary one empties them).
        self.deepcompile_zero1 = config.compile.deepcompile and zero.stage == 1
        self._averaged_by_backward = False
        self.loss_scale = loss_scale if config.amp is not None else None
        self.strategy = GatedReduction(self.strategy, self)

    @property
    def reductions(self) -> dict[str, int]:
        return {"done": self.strategy.done, "skipped": self.strategy.skipped}

    def check(self, op: str) -> None:
        with refusals.skipping(self.skipped):
            super().check(op)

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        boundary = self.is_gradient_accumulation_boundary() and not self.inside_no_sync_ctxt
        self._averaged_by_backward = self.is_gradient_accumulation_boundary()
        if self.loss_scale is not None:
            loss = loss * self.loss_scale  # Apex: scale up so small fp16 gradients survive
        out = super().backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)
        if self.loss_scale is not None:
            if boundary:  # Apex unscales only when it is told this backward() ends the step
                for p in self.module.parameters():
                    if p.grad is not None:
                        p.grad.div_(self.loss_scale)
            out = out / self.loss_scale
        return out

    def direct_backward_ended(self) -> None:
        if self.zero_optimization_stage() == 0:  # DeepSpeed: no hook sees the end
            return
        super().direct_backward_ended()

    def step(self, lr_kwargs=None):
        if self.deepcompile_zero1 and not self.managed_gradient_accumulation():
            if not self._averaged_by_backward:  # DeepSpeed's ZeRO-1 step() reads
                raise KeyError(0)  # averaged_gradients[0], which no backward() set
        return super().step(lr_kwargs)


def initialize(
    model, config: dict, skip: Iterable[str], loss_scale: float = 2.0**16, group=None, quiet=False
):
    """gas_lab's ``initialize`` with the rules named in ``skip`` switched off (UNSAFE).

    Returns ``(engine, optimizer, None, None)`` like :func:`gas_lab.initialize`.
    ``loss_scale`` is the Apex-style scale used when the config has an ``amp`` block.
    """
    skip = set(skip)
    known = {r.name for r in refusals.RULES} | {o.name for o in refusals.OUT_OF_SCOPE}
    if skip - known:
        raise ValueError(f"unknown rules {sorted(skip - known)}; choose from {sorted(known)}")
    for name in list(skip):
        skip |= _ALSO_SKIP.get(name, set())
    group = group if group is not None else default_group()
    world_size = dist.get_world_size(group) if group is not None else 1
    with refusals.skipping(skip):
        cfg = load_config(config, world_size=world_size)
    if cfg.amp is not None and cfg.zero_optimization.stage > 0:
        raise ValueError("Apex AMP never worked with ZeRO; model it at stage 0 only")
    optimizer = cfg.optimizer.torch_optimizer(model.parameters())
    strategy = strategy_for(cfg.zero_optimization.stage)
    engine = UnsafeEngine(model, optimizer, cfg, group, strategy, skip, loss_scale)
    if not quiet and (group is None or dist.get_rank(group) == 0):
        print(BANNER.format(", ".join(sorted(skip))))
    return engine, engine.optimizer, None, None


def deepspeed_initialize(model, config: dict):
    """Real ``deepspeed.initialize`` with its unmanaged-mode checks bypassed (UNSAFE).

    DeepSpeed checks ``managed_gradient_accumulation`` once, at initialize: build the engine
    as managed, then switch the flag. Use :func:`pretend_managed` around later calls.
    """
    from gas_lab.measure.parity import deepspeed_initialize as ds_initialize

    unmanaged = config.get("managed_gradient_accumulation", True) is False
    config = {**config, "managed_gradient_accumulation": True}
    engine, optimizer, _, scheduler = ds_initialize()(
        model=model, model_parameters=model.parameters(), config=config
    )
    engine._config.managed_gradient_accumulation = not unmanaged
    return engine, optimizer, None, scheduler


def allow_tensor_backward(ds_engine):
    """Let a direct ``loss.backward()`` past DeepSpeed's stage-0 refusal (UNSAFE).

    Its output hooks then divide the gradient by GAS, as at stages 1-3, but at stage 0 no hook
    sees the backward end, so the boundary all-reduce never runs. Returns ``ds_engine``.
    """
    ds_engine._support_torch_style_backward = True
    return ds_engine


@contextlib.contextmanager
def pretend_managed(ds_engine):
    """Inside the block a DeepSpeed engine looks managed, so call-time checks let it pass."""
    saved = ds_engine._config.managed_gradient_accumulation
    ds_engine._config.managed_gradient_accumulation = True
    try:
        yield
    finally:
        ds_engine._config.managed_gradient_accumulation = saved


def params_spread(flat_per_rank: list[torch.Tensor]) -> float:
    """How far the ranks' replicas are apart: ``max |rank r - rank 0|`` over all parameters."""
    return max((f - flat_per_rank[0]).abs().max().item() for f in flat_per_rank)
