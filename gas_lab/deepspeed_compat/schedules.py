"""Learning-rate schedules as DeepSpeed 0.19.8 runs them: the ``scheduler`` block, or your own.

A schedule here is what DeepSpeed calls an LR scheduler: an object with ``step()``,
``get_lr()``, ``state_dict()`` and ``load_state_dict()`` that writes each param group's ``lr``.
Two things decide what a learner sees, and both are DeepSpeed's:

* **When it steps.** The engine steps it once per *applied optimizer update*: at the boundary
  (managed: every GAS-th ``step()``; unmanaged: every ``step()``), never on a non-boundary
  ``step()`` and never on a skipped (overflow) update. ``step(lr_kwargs=...)`` hands the keyword
  arguments to ``scheduler.step(**lr_kwargs)`` at that moment (ignored otherwise).
* **Where it starts.** ``last_batch_iteration`` starts at -1 and the constructor already writes
  ``warmup_min_lr`` into the optimizer, so update 1 runs at -1 and update 2 at 0, where the
  warm-up factor is 0: **the first two updates both use ``warmup_min_lr``**.

The formulas, with ``i = last_batch_iteration`` and ``N = max(2, warmup_num_steps)``:

* ``WarmupLR``: ``lr = min + (max - min) * g``, ``g = log(i + 1) / log(N)`` ("log", the default)
  or ``i / N`` ("linear") while ``i < N``, then ``g = 1``. ``warmup_max_lr`` None (the default)
  means the optimizer's own lr.
* ``WarmupDecayLR``: the same warm-up (but ``warmup_max_lr`` defaults to 0.001), then
  ``g = max(0, (T - i) / max(1, T - N))`` with ``T = total_num_steps``.
* ``WarmupCosineLR``: a ratio of the optimizer's lr, from ``warmup_min_ratio`` up to 1, then a
  cosine down to ``cos_min_ratio`` at ``T``.

``initialize(lr_scheduler=...)`` wins over the config block, as in DeepSpeed: a scheduler object
is used as it is; a callable is called with the engine's torch optimizer. Taught in lesson 08
(``tutorials/08_edges.ipynb``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gas_lab.errors import ConfigError, NotImplementedInGasLab


class _Params(BaseModel):
    # DeepSpeed's own constructor arguments, checked: a typo is an error, not a default.
    model_config = ConfigDict(extra="forbid")


class WarmupParams(_Params):
    warmup_min_lr: float | list[float] = 0.0
    warmup_max_lr: float | list[float] | None = None
    warmup_num_steps: int = Field(1000, gt=0, strict=True)  # DeepSpeed: ValueError unless int > 0
    warmup_type: str = "log"
    last_batch_iteration: int = -1


class WarmupDecayParams(WarmupParams):
    total_num_steps: int
    warmup_max_lr: float | list[float] | None = 0.001  # not the optimizer's lr, unlike WarmupLR


class WarmupCosineParams(_Params):
    total_num_steps: int
    warmup_min_ratio: float = 0.0
    warmup_num_steps: int = Field(1000, gt=0, strict=True)
    cos_min_ratio: float = 0.0001
    warmup_type: str = "log"
    last_batch_iteration: int = -1


class SchedulerConfig(BaseModel):
    """The config's ``"scheduler": {"type": ..., "params": {...}}`` block."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: str
    params: dict[str, Any] = Field(default_factory=dict)

    def checked_params(self) -> _Params:
        try:
            return SCHEDULES[self.type][1].model_validate(self.params)
        except ValidationError as err:
            first = err.errors()[0]
            key = "scheduler.params." + ".".join(str(p) for p in first["loc"])
            raise ConfigError(key, first["msg"]) from None


class _Warmup:
    """What the three schedules share: the counter, the warm-up factor, writing the lrs."""

    def __init__(self, optimizer, warmup_num_steps, warmup_type, last_batch_iteration):
        if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps}")
        self.optimizer = optimizer
        self.warmup_num_steps = max(2, warmup_num_steps)  # log(1) = 0 would divide by zero
        # DeepSpeed logs a warning for an unknown type and falls back to "log"; so does gas_lab.
        self.warmup_type = warmup_type if warmup_type in ("log", "linear") else "log"
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:  # the constructor writes the starting lr, as DeepSpeed's
            self._write(self.get_lr())

    def _per_group(self, value, name):
        groups = self.optimizer.param_groups
        if isinstance(value, (list, tuple)):
            if len(value) != len(groups):
                raise ValueError(f"expected {len(groups)} values for {name}, got {len(value)}")
            return list(value)
        return [value] * len(groups)

    def _warmup_fraction(self) -> float:
        i = self.last_batch_iteration
        if self.warmup_type == "log":  # times 1/log(N), as DeepSpeed rounds it
            return (1.0 / math.log(self.warmup_num_steps)) * math.log(i + 1)
        return i / self.warmup_num_steps

    def _write(self, lrs) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        self._last_lr = list(lrs)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """One applied update happened: advance the counter (or set it) and write the lrs."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._write(self.get_lr())

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}  # all DeepSpeed saves

    def load_state_dict(self, state: dict) -> None:
        # Only the counter, as DeepSpeed: the lrs are written at the next step().
        self.last_batch_iteration = state["last_batch_iteration"]


class WarmupLR(_Warmup):
    """``min -> max`` over ``warmup_num_steps`` updates, then ``max``."""

    def __init__(
        self,
        optimizer,
        warmup_min_lr=0.0,
        warmup_max_lr=None,
        warmup_num_steps=1000,
        warmup_type="log",
        last_batch_iteration=-1,
    ):
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in optimizer.param_groups]
        self.optimizer = optimizer
        self.min_lrs = self._per_group(warmup_min_lr, "min_lr")
        self.max_lrs = self._per_group(warmup_max_lr, "max_lr")
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:  # not started: the minimum
            return list(self.min_lrs)
        g = self._gamma()
        return [lo + (hi - lo) * g for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """Warm up as :class:`WarmupLR`, then decay linearly to 0 at ``total_num_steps``."""

    def __init__(
        self,
        optimizer,
        total_num_steps,
        warmup_min_lr=0.0,
        warmup_max_lr=0.001,
        warmup_num_steps=1000,
        warmup_type="log",
        last_batch_iteration=-1,
    ):
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        left = self.total_num_steps - self.last_batch_iteration
        return max(0.0, left / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Warmup):
    """A ratio of the optimizer's lr: ``warmup_min_ratio -> 1``, then a cosine to
    ``cos_min_ratio`` at ``total_num_steps`` (and it stays there)."""

    def __init__(
        self,
        optimizer,
        total_num_steps,
        warmup_min_ratio=0.0,
        warmup_num_steps=1000,
        cos_min_ratio=0.0001,
        warmup_type="log",
        last_batch_iteration=-1,
    ):
        self.total_num_steps, self.cos_min_ratio = total_num_steps, cos_min_ratio
        self.warmup_min_ratio = warmup_min_ratio
        self.org_lrs = [group["lr"] for group in optimizer.param_groups]
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)

    def _ratio(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self.warmup_min_ratio + self._warmup_fraction() * (1.0 - self.warmup_min_ratio)
        done = self.last_batch_iteration - self.warmup_num_steps + 1
        progress = min(1.0, done / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self._ratio()
        return [lr * ratio for lr in self.org_lrs]


SCHEDULES = {
    "WarmupLR": (WarmupLR, WarmupParams),
    "WarmupDecayLR": (WarmupDecayLR, WarmupDecayParams),
    "WarmupCosineLR": (WarmupCosineLR, WarmupCosineParams),
}
_DEEPSPEED_ONLY = ("LRRangeTest", "OneCycle")


def check(block: SchedulerConfig | None) -> None:
    """Validate a config's scheduler block (names and params) before anything is built."""
    if block is None:
        return
    if block.type in SCHEDULES:
        block.checked_params()
    elif block.type in _DEEPSPEED_ONLY:
        raise NotImplementedInGasLab(
            f"scheduler.type {block.type!r}: gas_lab implements WarmupLR, WarmupDecayLR and "
            "WarmupCosineLR; use deepspeed.initialize for the others."
        )
    elif not hasattr(torch.optim.lr_scheduler, block.type):
        raise ConfigError(
            "scheduler.type",
            f"{block.type!r} is neither a DeepSpeed nor a torch.optim.lr_scheduler schedule",
        )


def configure(block: SchedulerConfig | None, client, optimizer, stage: int):
    """The engine's ``lr_scheduler``, chosen as DeepSpeed 0.19.8 chooses it.

    ``client`` (``initialize(lr_scheduler=...)``) wins: a callable is called with the torch
    optimizer, anything else is used as it is (even one bound to another optimizer: DeepSpeed
    does not check, and such a scheduler then changes nothing the engine uses). Otherwise the
    config block, or None.
    """
    if client is not None:
        return client(optimizer) if callable(client) else client
    if block is None:
        return None
    if block.type in SCHEDULES:
        cls, _ = SCHEDULES[block.type]
        return cls(optimizer, **block.checked_params().model_dump())
    if stage >= 1:
        # DeepSpeed builds a torch schedule named in the config on its ZeRO wrapper, which
        # torch refuses; the same code works with lr_scheduler=callable.
        raise TypeError(
            f"scheduler.type {block.type!r} at ZeRO stage {stage}: DeepSpeed 0.19.8 builds it on "
            "its DeepSpeedZeroOptimizer wrapper and torch raises 'DeepSpeedZeroOptimizer is not "
            "an Optimizer'. Pass initialize(lr_scheduler=lambda opt: ...) instead."
        )
    return getattr(torch.optim.lr_scheduler, block.type)(optimizer, **block.params)


def step_after_update(scheduler, lr_kwargs: dict | None, train_batch_size: int) -> None:
    """What the engine does after an applied update: ``scheduler.step(**lr_kwargs)``.

    A scheduler whose ``step()`` does not take those arguments gets ``step(train_batch_size)``
    instead: DeepSpeed's fallback for Megatron-style schedulers, kept so both behave alike.
    """
    if scheduler is None:
        return
    try:
        scheduler.step(**(lr_kwargs or {}))
    except TypeError:
        scheduler.step(train_batch_size)
