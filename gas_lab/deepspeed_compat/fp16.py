"""An fp16 training loop written against gas_lab's loss scaler, counting like DeepSpeed's engine.

:class:`Fp16Loop` has the engine's loop API (``backward``, ``step``, ``global_steps``,
``global_samples``, ``micro_steps``, ``skipped_steps``, ``was_step_applied``), so the same loop
runs on it and on ``deepspeed.initialize`` with ``"fp16": {"enabled": true}``. It keeps the model
in fp16 and an fp32 master copy of every parameter for the optimizer, as DeepSpeed's fp16
optimizers do. At each accumulation boundary:

1. average the fp16 gradients over the ranks;
2. ask every rank whether any gradient is inf/NaN (:meth:`DynamicLossScaler.found_overflow`);
3. move the scale (:meth:`DynamicLossScaler.update`), *before* unscaling, as DeepSpeed does;
4. overflow: drop the gradients, ``skipped_steps += 1``, no optimizer step, the LR scheduler
   does not step. Otherwise: copy the gradients to the fp32 masters, unscale, clip, step, copy
   the masters back into the fp16 model, step the scheduler;
5. either way ``global_steps`` and ``global_samples`` advance, as in DeepSpeed 0.19.8
   (``engine.py:3534-3565``): a skipped step still consumed its samples.

At ZeRO stage 0 DeepSpeed 0.19.8 does two more things, reproduced while
``stage0_as_deepspeed`` is true (the default, so that the parameters match DeepSpeed's):

* its ``engine.backward`` scales the loss only for ZeRO optimizers (``engine.py:3413-3421``),
  yet the stage-0 fp16 optimizer still divides by the scale at the step: the fp16 gradient gets
  no protection from underflow and the update uses ``gradient / scale`` (Adam hardly notices, SGD
  takes a step ``scale`` times too small): a trap;
* its fp16 optimizers run one optimizer step on zero gradients when they are built
  (``unfused_optimizer.py:412-425``, ``fused_optimizer.py:125-130``), so Adam's bias correction
  counts one step more than a fresh Adam's.

The loss scaler itself is :mod:`gas_lab.deepspeed_compat.loss_scaling`; the whole topic is taught in appendix A1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gas_lab.deepspeed_compat.config import parse, with_batch
from gas_lab.deepspeed_compat.loss_scaling import for_deepspeed
from gas_lab.deepspeed_compat.norms import replicated_grad_norm
from gas_lab.dp import all_reduce_mean, clip_by_norm, default_group
from gas_lab.engine import is_boundary, samples_run


class Fp16Loop:
    """fp16 model + fp32 masters + :func:`gas_lab.deepspeed_compat.loss_scaling.for_deepspeed`'s scaler.

    ``config`` is a DeepSpeed config dict (batch sizes, ``optimizer``, ``fp16``,
    ``gradient_clipping``, ``managed_gradient_accumulation``, ``zero_optimization.stage``). The
    stage picks the scaler's rules only: the update itself is replicated (ZeRO-1's sharding gives
    the same numbers, lesson 05). ``lr_scheduler`` is a callable that takes the fp32 optimizer,
    as ``deepspeed.initialize(lr_scheduler=...)`` accepts.
    """

    def __init__(self, model, config: dict, lr_scheduler=None, stage0_as_deepspeed: bool = True):
        self.group = default_group()
        world = dist.get_world_size(self.group) if self.group is not None else 1
        cfg = with_batch(parse(config), world)  # not load_config: its rules refuse fp16
        self._train_batch = cfg.train_batch_size
        self._micro, self._gas = cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
        self._managed = cfg.managed_gradient_accumulation
        self._clip = cfg.gradient_clipping
        self.module = model.half()
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.masters = [p.detach().clone().float() for p in self.params]
        self.optimizer = cfg.optimizer.torch_optimizer(self.masters)
        stage = cfg.zero_optimization.stage
        quirks = stage == 0 and stage0_as_deepspeed
        if quirks:  # DeepSpeed's stage-0 fp16 optimizers step once on zero gradients at start
            for m in self.masters:
                m.grad = torch.zeros_like(m)
            self.optimizer.step()
            for m in self.masters:
                m.grad = None
        self.scale_in_backward = not quirks
        self.lr_scheduler = lr_scheduler(self.optimizer) if lr_scheduler else None
        self.scaler = for_deepspeed(config.get("fp16"), stage)
        self.global_steps = self.global_samples = self.micro_steps = self.skipped_steps = 0
        self._backward_count = 0  # backward() calls since the last boundary (unmanaged)
        self._step_applied = False
        self.last_event = None  # what the scaler did at the last boundary

    # -- the loop API ----------------------------------------------------------------------------
    def __call__(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Accumulate this micro-batch's gradient, scaled by the step's loss scale."""
        loss = loss / self._gas if scale_wrt_gas else loss
        self._backward_count += 1
        (self.scaler.scale_loss(loss) if self.scale_in_backward else loss).backward()
        return loss

    def is_gradient_accumulation_boundary(self) -> bool:
        return not self._managed or is_boundary(self.micro_steps, self._gas)

    def step(self) -> None:
        if self.is_gradient_accumulation_boundary():
            self._step_applied = self.update()
            self.global_steps += 1
            if self._managed:
                self.global_samples += self._train_batch
            else:
                world = self._train_batch // (self._micro * self._gas)
                self.global_samples += samples_run(self._backward_count, self._micro, world)
            self._backward_count = 0
        self.micro_steps += 1

    def was_step_applied(self) -> bool:
        return self._step_applied

    def managed_gradient_accumulation(self) -> bool:
        return self._managed

    def gradient_accumulation_steps(self) -> int:
        return self._gas

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._micro

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    # -- the boundary ----------------------------------------------------------------------------
    def update(self) -> bool:
        """The boundary: reduce, check for overflow, move the scale, then step or skip."""
        for p in self.params:
            if p.grad is None:  # unused on this rank: it still joins the reduction
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.params]
        all_reduce_mean(grads, self.group)
        overflow = self.scaler.found_overflow(grads, self.group)
        self.last_event = self.scaler.update(overflow)  # before unscaling, as DeepSpeed does
        if overflow:
            self._drop_gradients()
            self.skipped_steps += 1
            return False
        for master, p in zip(self.masters, self.params, strict=True):
            master.grad = p.grad.float()
        master_grads = [m.grad for m in self.masters]
        self.scaler.unscale_(master_grads)
        if self._clip > 0:
            clip_by_norm(master_grads, replicated_grad_norm(master_grads), self._clip)
        self.optimizer.step()
        with torch.no_grad():
            for master, p in zip(self.masters, self.params, strict=True):
                p.copy_(master)
                master.grad = None
        self._drop_gradients()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return True

    def _drop_gradients(self) -> None:
        for p in self.params:
            p.grad = None
