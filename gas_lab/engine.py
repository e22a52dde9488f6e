"""The gas_lab engine: DeepSpeed's training-loop API, small enough to read.

A loop written for ``deepspeed.initialize`` runs unchanged on :func:`initialize`::

    engine, optimizer, _, _ = initialize(model=model, model_parameters=model.parameters(),
                                         config=cfg)
    loss = loss_fn(engine(x), y)
    engine.backward(loss)   # accumulate (and, at a managed boundary, all-reduce)
    engine.step()           # update, or only count the micro-step

Two ways to find the accumulation boundary (the micro-batch after which ranks reduce their
gradients and the optimizer updates the weights):

* **managed** (default): the engine counts micro-steps. The boundary is the micro-batch with
  ``(micro_steps + 1) % gradient_accumulation_steps == 0``; its ``backward()`` all-reduces and
  the following ``step()`` updates. Every other ``step()`` only advances ``micro_steps``.
* **unmanaged** (``"managed_gradient_accumulation": false``): the caller decides. ``backward()``
  only accumulates locally, and *every* ``step()`` is a boundary: all-reduce, then one update,
  however many micro-batches ran since the last one (that number may change every step).

A direct ``loss.backward()`` is seen by a hook on the model's output, as in DeepSpeed 0.19.8:
refused at ZeRO stage 0; at stages 1 and 2 it divides by GAS and reduces like
``engine.backward(loss)``, but only ``engine.backward()`` counts towards ``global_samples``.

The "reduce, then update" part is delegated to a small strategy object
(:mod:`gas_lab.deepspeed_compat.strategies`), so that ZeRO-1 (:mod:`gas_lab.zero1`) and ZeRO-2
(:mod:`gas_lab.zero2`, which reduces in every backward: the engine calls the strategy's
optional ``after_backward()``) replace it without touching the counting logic here.

Taught in lessons 03 (managed, ``tutorials/03_managed.ipynb``) and 04 (unmanaged,
``tutorials/04_unmanaged.ipynb``). Lesson 08 (``tutorials/08_edges.ipynb``) adds what a real
loop needs around it, each in its own module: the LR schedule stepped at applied updates
(:mod:`gas_lab.deepspeed_compat.schedules`), checkpoints (:mod:`gas_lab.deepspeed_compat.checkpoint`), bf16
(:mod:`gas_lab.deepspeed_compat.precision`) and the data loader ``initialize`` returns (:mod:`gas_lab.deepspeed_compat.loader`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from gas_lab.deepspeed_compat import checkpoint, loader, precision, schedules
from gas_lab.deepspeed_compat.config import GasConfig, load_config
from gas_lab.deepspeed_compat.strategies import strategy_for
from gas_lab.dp import broadcast_parameters, default_group
from gas_lab.errors import NotImplementedInGasLab
from gas_lab.rules import refusals
from gas_lab.rules.refusals import Situation


class Engine(torch.nn.Module):
    """Wraps a module; counts micro-steps; reduces and updates at accumulation boundaries."""

    def __init__(self, module, optimizer, config: GasConfig, group, strategy_cls):
        super().__init__()
        self.module = module
        self._config = config
        self.group = group
        self.global_steps = 0  # optimizer updates so far
        self.global_samples = 0  # samples (all ranks) consumed by those updates
        self.micro_steps = 0  # step() calls so far, boundary or not
        self.skipped_steps = 0  # updates skipped for a non-finite gradient norm
        self.lr_scheduler = None  # set by initialize (lesson 08)
        self.training_dataloader = None  # initialize(training_data=...) (lesson 08)
        self.inside_no_sync_ctxt = False
        self._unmanaged_backward_count = 0  # backward() calls since the last step()
        self._window_empty = True  # no backward, no reduction since the last update (lesson 07)
        self._boundary_override = None  # set_gradient_accumulation_boundary() (managed only)
        self._inside_step = False  # unmanaged: the boundary is "inside step()"
        self._inside_engine_backward = False  # the output hooks leave engine.backward() alone
        self._direct_backward_seen = False  # a direct loss.backward() is running
        self._step_applied = False
        broadcast_parameters(module, group)  # ranks may have initialized differently
        self._update = strategy_cls(list(module.parameters()), optimizer, group, config)
        self.optimizer = self._update.optimizer
        self.precision = getattr(self._update, "precision", None)  # lesson 08: where it rounds

    # -- the training loop ---------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        out = self.module(*inputs, **kwargs)
        # A hook on each output sees every backward pass through it start, engine's or not.
        self._direct_backward_seen = False  # (a backward that failed half-way left it set)
        for tensor in _output_tensors(out):
            if tensor.requires_grad:
                tensor.register_hook(self._on_output_grad)
        return out

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        """Accumulate gradients of ``loss`` (divided by GAS unless scale_wrt_gas is False)."""
        if not (torch.is_tensor(loss) and loss.numel() == 1):
            raise ValueError("engine.backward() expects a scalar loss tensor")
        if not self.managed_gradient_accumulation():
            self._unmanaged_backward_count += 1  # global_samples counts what really ran
        if scale_wrt_gas:
            # Gradients add up over micro-batches; dividing each loss by GAS turns the sum of
            # GAS micro-batch means into the mean over the whole batch.
            loss = loss / self.gradient_accumulation_steps()
        self._inside_engine_backward = True  # the hooks on the output leave this pass alone
        self._strategy_hook("before_backward")
        try:
            loss.backward(retain_graph=retain_graph)
        finally:
            self._inside_engine_backward = False
        # e.g. bf16 gradients added into fp32 buffers; ZeRO-2 reduces its last bucket
        self._strategy_hook("after_backward")
        self._window_empty = False
        # Managed: the boundary micro-batch reduces right away (unless inside no_sync()).
        # Unmanaged, this is never the boundary (only step() is): gradients stay local.
        self._reduce_if_boundary()
        return loss

    def _reduce_if_boundary(self):
        if self.is_gradient_accumulation_boundary() and not self.inside_no_sync_ctxt:
            self._update.reduce_gradients()

    def _on_output_grad(self, grad):
        """Hook on the model's output: a backward pass reached it. Only a direct
        ``loss.backward()`` gets past the first line: refused at stage 0 (``rules``); at stage 1
        divided by GAS here, and reduced once autograd has filled every ``.grad``."""
        if self._inside_engine_backward:
            return grad
        if not self._direct_backward_seen:  # once per pass, however many outputs it reaches
            refusals.enforce(self._situation("tensor.backward"))
            self._direct_backward_seen = True
            self._strategy_hook("before_backward")
            # Run once this pass ends (DeepSpeed's ZeRO optimizers use the same autograd call).
            torch.autograd.Variable._execution_engine.queue_callback(self._after_direct_backward)
        return grad / self.gradient_accumulation_steps()  # what scale_wrt_gas=True does

    def _after_direct_backward(self):
        self._direct_backward_seen = False
        self._window_empty = False
        self._strategy_hook("after_backward")
        self._reduce_if_boundary()

    def _strategy_hook(self, name: str, *args) -> None:
        # Optional: strategies with extra buffers (bf16) or that reduce in backward (ZeRO-2).
        hook = getattr(self._update, name, None)
        if hook is not None:
            hook(*args)

    def step(self, lr_kwargs=None):
        """Managed: update only at the boundary. Unmanaged: reduce, then update, every call.

        After an applied update the LR scheduler steps (``scheduler.step(**lr_kwargs)``); a
        skipped update (non-finite gradient norm) counts in ``skipped_steps`` instead.
        """
        refusals.enforce(self._situation("step"))
        self._step_applied = False
        self._inside_step = True
        try:
            if not self.managed_gradient_accumulation():
                self._update.reduce_gradients()
            if self.is_gradient_accumulation_boundary():
                self._window_empty = True  # a new accumulation window starts
                self._step_applied = self._update.update()
                if self._step_applied:
                    schedules.step_after_update(self.lr_scheduler, lr_kwargs,
                                                self.train_batch_size())  # fmt: skip
                else:
                    self.skipped_steps += 1
                self.global_steps += 1  # counted even when skipped, as DeepSpeed does
                if self.managed_gradient_accumulation():
                    self.global_samples += self.train_batch_size()
                else:  # the caller chose how many micro-batches went into this update
                    micro_batches, self._unmanaged_backward_count = (
                        self._unmanaged_backward_count,
                        0,
                    )
                    self.global_samples += self._config.samples_per_micro_batch * micro_batches
        finally:
            self._inside_step = False
        self.micro_steps += 1  # counts every step() call, boundary or not, as DeepSpeed does

    # -- the boundary ----------------------------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        if not self.managed_gradient_accumulation():
            return self._inside_step
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Managed only: True or False overrides the counter, and it stays overridden until
        set again; None hands the boundary back to the counter (as in DeepSpeed)."""
        refusals.enforce(self._situation("set_gradient_accumulation_boundary"))
        self._boundary_override = is_boundary

    @contextlib.contextmanager
    def no_sync(self):
        """Skip the boundary all-reduce in backward() (gradients stay local) inside the block."""
        refusals.enforce(self._situation("no_sync"))
        self.inside_no_sync_ctxt = True
        try:
            yield
        finally:
            self.inside_no_sync_ctxt = False

    @contextlib.contextmanager
    def coalesce_grad_reduction(self):
        """ZeRO-1, managed: the backward() calls of one optimizer step, reduced once.

        Inside the block backward() keeps the gradients local, as inside no_sync(), and step()
        is refused; leaving the block reduces them once, boundary or not (even when left by an
        exception, as in DeepSpeed), and the next boundary step() updates from that. Refused
        unmanaged, at stage 0 and nested, as by DeepSpeed.
        """
        refusals.enforce(self._situation("coalesce_grad_reduction"))
        self.inside_no_sync_ctxt = True
        self._strategy_hook("defer_reduction", True)  # ZeRO-2 would reduce inside backward()
        try:
            yield
        finally:
            self.inside_no_sync_ctxt = False
            self._strategy_hook("defer_reduction", False)
            self._update.reduce_gradients()
            self._window_empty = False  # reduced, even if nothing: DeepSpeed then steps

    def _situation(self, action: str) -> Situation:
        # An update ahead (unmanaged: every step(); managed: the boundary) from no backward().
        update = (
            not self.managed_gradient_accumulation() or self.is_gradient_accumulation_boundary()
        )
        idle = action == "step" and update and self._window_empty
        return Situation(self._config, action, inside_no_sync=self.inside_no_sync_ctxt, idle=idle)

    # -- read-only facts, named as in DeepSpeed --------------------------------------------------
    def was_step_applied(self) -> bool:
        return self._step_applied

    def managed_gradient_accumulation(self) -> bool:
        return self._config.managed_gradient_accumulation

    def gradient_accumulation_steps(self) -> int:
        return self._config.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.train_micro_batch_size_per_gpu

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def zero_optimization_stage(self) -> int:
        return self._config.zero_optimization.stage

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def zero_grad(self) -> None:
        for p in self.module.parameters():
            p.grad = None

    def destroy(self) -> None:
        """Release what the engine attached to the model, as DeepSpeed's ``engine.destroy()``:
        at ZeRO-1 the attributes that expose sharded gradients (at stage 0 nothing is attached).
        The module keeps its trained weights and can be used without the engine."""
        self._strategy_hook("destroy")

    # -- checkpoints (lesson 08, gas_lab/deepspeed_compat/checkpoint.py) ------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True) -> bool:
        """Save on every rank; exact only at a boundary (gradients are not saved)."""
        return checkpoint.save(self, self._update, save_dir, tag, client_state, save_latest)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True,
                        load_optimizer_states=True, load_lr_scheduler_states=True,
                        load_module_only=False):  # fmt: skip
        """Restore weights, optimizer, scheduler and counters: ``(path, client_state)``."""
        return checkpoint.load(self, self._update, load_dir, tag, load_module_strict,
                               load_optimizer_states, load_lr_scheduler_states,
                               load_module_only)  # fmt: skip


def initialize(
    args=None,
    model=None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    config=None,
    collate_fn=None,
    group=None,
    strategy=None,
    **more,
):
    """gas_lab's ``deepspeed.initialize``: ``(engine, optimizer, training_dataloader,
    lr_scheduler)``, the same four values (the last two None when not asked for).

    ``training_data``: a map-style Dataset; the third value is this rank's loader of
    micro-batches (:mod:`gas_lab.deepspeed_compat.loader`). ``lr_scheduler``: a scheduler object, or a callable
    given the torch optimizer; it wins over the config's ``scheduler`` block
    (:mod:`gas_lab.deepspeed_compat.schedules`). The process group is ``group`` if given, else
    :func:`gas_lab.dp.default_group` (the default group, or one started from torchrun's
    variables as DeepSpeed would, or none). ``strategy`` is how the boundary reduces and
    updates (:mod:`gas_lab.deepspeed_compat.strategies`); None picks the one for the config's ZeRO stage.
    DeepSpeed's other arguments (args, mpu, ...) are refused rather than silently ignored.
    """
    unsupported = sorted(k for k, v in {"args": args, **more}.items() if v is not None)
    if unsupported:
        raise NotImplementedInGasLab(f"initialize(): gas_lab does not take {unsupported}")
    group = group if group is not None else default_group()
    world_size = dist.get_world_size(group) if group is not None else 1
    cfg = load_config(config if config is not None else {}, world_size=world_size)
    pipeline = any(c.__name__ == "PipelineModule" for c in type(model).__mro__)
    refusals.enforce(Situation(cfg, pipeline=pipeline))
    precision.cast_parameters(model, cfg.model_dtype)  # bf16: the weights, not the buffers
    if optimizer is None:  # as in DeepSpeed, a client optimizer wins over the config's
        if cfg.optimizer is None:
            raise NotImplementedInGasLab(
                "gas_lab engines train: give config['optimizer'] or optimizer=..."
            )
        params = model_parameters if model_parameters is not None else model.parameters()
        optimizer = cfg.optimizer.torch_optimizer(params)
    strategy = strategy or strategy_for(cfg.zero_optimization.stage)
    engine = Engine(model, optimizer, cfg, group, strategy)
    engine.lr_scheduler = schedules.configure(
        cfg.scheduler, lr_scheduler, engine.optimizer, cfg.zero_optimization.stage
    )
    if training_data is not None:
        rank = dist.get_rank(group) if group is not None else 0
        engine.training_dataloader = loader.training_loader(
            training_data, cfg.train_micro_batch_size_per_gpu, world_size, rank, collate_fn,
            cfg.dataloader_drop_last,
        )  # fmt: skip
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _output_tensors(out) -> list[torch.Tensor]:
    """The tensors in a forward's output: a tensor, or tuples, lists and dicts of them."""
    if torch.is_tensor(out):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for item in out for t in _output_tensors(item)]
    return []
