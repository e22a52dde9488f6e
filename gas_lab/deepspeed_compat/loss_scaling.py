"""fp16 dynamic loss scaling, from scratch, with gradient accumulation.

fp16 keeps 5 exponent bits: a gradient below about 6e-8 rounds to zero and one above 65504
becomes ``inf``. Multiplying the loss by a scale ``S`` before ``backward()`` multiplies every
gradient by ``S`` too, lifting small gradients into range; dividing by ``S`` before the optimizer
step gives the true gradient back. *Dynamic* scaling guesses ``S``: start high, halve it when the
gradient overflows (and skip that update), double it after a window of clean steps.

With gradient accumulation the scale is a property of the *step*, not of the micro-batch:

* every micro-batch of a step is scaled by the same ``S`` (the scale changes only at the
  boundary), so the accumulated gradient is ``S`` times the sum;
* the overflow check runs once, at the boundary, on the accumulated (and reduced) gradient, and
  every rank takes the maximum of the ranks' answers: one ``inf`` in one micro-batch on one rank
  poisons the sum, and the *whole* step is skipped on every rank.

:class:`DynamicLossScaler` follows DeepSpeed 0.19.8's rules (``deepspeed/runtime/fp16/``):

* ``update(overflow)`` is ``DynamicLossScaler.update_scale`` (``loss_scaler.py:253-288``): on an
  overflow, spend one unit of *hysteresis*, or once it is spent halve the scale (never below
  ``min_scale``; at ``min_scale`` raise :class:`LossScaleAtMinimum`); after
  ``scale_window`` overflow-free steps since the last overflow, double it and refill the
  hysteresis. ZeRO stages 1 and 2 use exactly that. Stage 0 wraps the optimizer in
  ``FP16_Optimizer``/``FP16_UnfusedOptimizer``, whose own ``_update_scale``
  (``unfused_optimizer.py:277-301``) has no hysteresis and stops at ``min_scale`` without
  raising: :func:`for_deepspeed` builds the one that matches a config and a stage.
* DeepSpeed updates the scale *before* it unscales (``unfused_optimizer.py:227-228``,
  ``stage_1_and_2.py:3047`` then ``:3198``): on a step where the scale grows, the gradient is
  divided by the *new* scale, so that one update uses half the gradient. A loop matching
  DeepSpeed calls :meth:`update` first, then :meth:`unscale_`.

The training loop that uses it, counting steps like DeepSpeed's engine, is
:class:`gas_lab.deepspeed_compat.fp16.Fp16Loop`.

Taught in appendix A1 (``tutorials/A1_fp16_loss_scaling.ipynb``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from gas_lab.errors import ConfigError, GasLabError

# DeepSpeed 0.19.8's fp16 defaults (deepspeed/runtime/precision_config.py:135-155).
DEFAULTS = {
    "loss_scale": 0,  # 0 means dynamic
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "consecutive_hysteresis": False,
    "min_loss_scale": 1,
}


class LossScaleAtMinimum(GasLabError):
    """The gradient overflowed with the scale already at ``min_scale`` (ZeRO stages 1 and 2).

    DeepSpeed raises a plain ``Exception`` here and stops the run; this is one too.
    """


class DynamicLossScaler:
    """The loss scale and the rules that move it; one object per training run.

    ``scale``: what every micro-batch's loss is multiplied by until the next :meth:`update`.
    ``dynamic=False`` keeps ``init_scale`` forever (DeepSpeed's static ``loss_scale``); overflows
    still skip steps.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        scale_window: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        consecutive_hysteresis: bool = False,
        raise_at_min_scale: bool = True,
        dynamic: bool = True,
    ):
        for name, value in (("init_scale", init_scale), ("min_scale", min_scale)):
            if not value > 0:
                raise ValueError(f"{name}={value!r}: a loss scale must be > 0")
        if scale_window < 1:
            raise ValueError(f"scale_window={scale_window!r}: must be >= 1 (steps between growths)")
        if hysteresis < 1:
            raise ValueError(f"hysteresis={hysteresis!r}: must be >= 1 (1 = halve at once)")
        self.scale = float(init_scale)
        self.scale_window, self.min_scale = scale_window, float(min_scale)
        self.hysteresis, self.hysteresis_left = hysteresis, hysteresis
        self.consecutive_hysteresis, self.raise_at_min_scale = (
            consecutive_hysteresis,
            raise_at_min_scale,
        )
        self.dynamic = dynamic
        self.iteration = 0  # update() calls so far: one per boundary, overflow or not
        self.last_overflow_iteration = -1

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaler(scale={self.scale:g}, iteration={self.iteration}, "
            f"hysteresis_left={self.hysteresis_left})"
        )

    # -- each micro-batch ----------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward()`` on: in fp32, times the current scale."""
        return loss.float() * self.scale

    # -- at the boundary -----------------------------------------------------------------------
    @staticmethod
    def found_overflow(grads: Iterable[torch.Tensor | None], group=None) -> bool:
        """Whether any gradient holds an inf or a NaN, on any rank of ``group``.

        The answer is reduced with MAX over the ranks (one small all-reduce), because ranks
        that disagree would skip different steps and their weights would drift apart.
        """
        grads = [g for g in grads if g is not None]
        device = grads[0].device if grads else torch.device("cpu")
        bad = torch.zeros(1, device=device)
        for g in grads:
            bad += (~torch.isfinite(g)).any().float()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            if dist.get_backend(group) == "nccl" and bad.device.type != "cuda":
                bad = bad.cuda()
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
        return bool(bad.item() > 0)

    def update(self, overflow: bool) -> str:
        """Move the scale after a step; returns what happened: ``"halved"``, ``"hysteresis"``
        (an overflow absorbed without halving), ``"doubled"`` or ``"kept"``."""
        event = "kept"
        if not self.dynamic:
            pass
        elif overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                if self.scale == self.min_scale and self.raise_at_min_scale:
                    raise LossScaleAtMinimum(
                        f"the gradient overflowed with the loss scale already at min_scale="
                        f"{self.min_scale:g}: it cannot be lowered further (DeepSpeed stops "
                        "the run here too). Look for an inf/NaN in the loss or the data."
                    )
                self.scale, event = max(self.scale / 2.0, self.min_scale), "halved"
            else:
                self.hysteresis_left, event = self.hysteresis_left - 1, "hysteresis"
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            stable = self.iteration - self.last_overflow_iteration - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale, event = self.scale * 2.0, "doubled"
        self.iteration += 1
        return event

    def unscale_(self, grads: Iterable[torch.Tensor | None]) -> None:
        """Divide the accumulated gradients by the scale, in place (after :meth:`update`)."""
        inverse = 1.0 / self.scale  # a power of two: multiplying by it is exact
        for g in grads:
            if g is not None:
                g.mul_(inverse)


def fp16_settings(fp16: dict | None) -> dict:
    """DeepSpeed's ``fp16`` block with its defaults filled in, checked as DeepSpeed checks it."""
    fp16 = dict(fp16 or {})
    unknown = set(fp16) - set(DEFAULTS) - {"enabled", "auto_cast"}
    if unknown:
        raise ConfigError(f"fp16.{sorted(unknown)[0]}", "not an fp16 key gas_lab's scaler knows")
    settings = DEFAULTS | {k: v for k, v in fp16.items() if k in DEFAULTS}
    if settings["loss_scale"] < 0:
        raise ConfigError("fp16.loss_scale", "must be >= 0 (0 enables dynamic loss scaling)")
    if settings["loss_scale"] == 0:  # the window and the floor matter only when dynamic
        if settings["loss_scale_window"] <= 0:
            raise ConfigError("fp16.loss_scale_window", "must be > 0 with dynamic loss scaling")
        if settings["min_loss_scale"] <= 0:
            raise ConfigError("fp16.min_loss_scale", "must be > 0 with dynamic loss scaling")
    return settings


def for_deepspeed(fp16: dict | None, stage: int) -> DynamicLossScaler:
    """The scaler DeepSpeed 0.19.8 builds for this ``fp16`` block at ZeRO ``stage``.

    Stage 0 (``FP16_UnfusedOptimizer``/``FP16_Optimizer``): no hysteresis, no error at the
    floor. Stages 1 and 2 (``DynamicLossScaler``): the config's hysteresis, and an error when an
    overflow comes with the scale already at ``min_loss_scale``.
    """
    s = fp16_settings(fp16)
    if s["loss_scale"] > 0:
        return DynamicLossScaler(init_scale=s["loss_scale"], dynamic=False)
    zero = stage >= 1
    if zero and s["hysteresis"] < 1:  # DeepSpeed accepts it, and then never lowers the scale
        raise ConfigError(
            "fp16.hysteresis", "must be >= 1 at ZeRO stages 1-2 (below 1 the scale never drops)"
        )
    return DynamicLossScaler(
        init_scale=2.0 ** s["initial_scale_power"],
        scale_window=s["loss_scale_window"],
        hysteresis=s["hysteresis"] if zero else 1,
        min_scale=s["min_loss_scale"],
        consecutive_hysteresis=s["consecutive_hysteresis"] if zero else False,
        raise_at_min_scale=zero,
    )
