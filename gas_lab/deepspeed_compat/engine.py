"""DeepSpeed's engine: gas_lab's floor (:mod:`gas_lab.engine`) plus what DeepSpeed 0.19.8 does
around it, so that a loop written for ``deepspeed.initialize`` runs unchanged on
:func:`initialize` and ends with DeepSpeed's numbers::

    engine, optimizer, _, _ = initialize(model=model, model_parameters=model.parameters(),
                                         config=cfg)   # or args=args with --deepspeed_config
    loss = loss_fn(engine(x), y)
    engine.backward(loss)   # accumulate (and, at a managed boundary, reduce)
    engine.step()           # update, or only count the micro-step

What this layer adds to the floor's counting and boundary, each at one named place:

* the config, with DeepSpeed's keys and defaults (:mod:`.config`), and DeepSpeed's refusals,
  checked where DeepSpeed checks them (:meth:`DeepSpeedEngine.check`, :mod:`gas_lab.rules`);
* a direct ``loss.backward()``, seen by a hook on the model's output as in DeepSpeed: refused at
  ZeRO stage 0; at stages 1 and 2 divided by GAS and reduced like ``engine.backward(loss)``, but
  only ``engine.backward()`` counts towards ``global_samples``;
* the strategy for the config's ZeRO stage, with DeepSpeed's buckets and precision
  (:mod:`.strategies`); updates skipped on a non-finite norm (``skipped_steps``);
  ``set_gradient_accumulation_boundary()`` and ``coalesce_grad_reduction()``;
* the LR schedule stepped at applied updates (:mod:`.schedules`), checkpoints
  (:mod:`.checkpoint`), the data loader (:mod:`.loader`), and the names training loops read
  (``local_rank``, ``device``, ``world_size``, ``get_global_grad_norm()``, ...).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.distributed as dist

from gas_lab.deepspeed_compat import checkpoint, loader, precision, schedules
from gas_lab.deepspeed_compat.config import GasConfig, choose_config, load_config, read_config
from gas_lab.deepspeed_compat.devices import device_for, device_of, set_up_deepspeed_comm
from gas_lab.deepspeed_compat.strategies import DeepSpeedStrategy, strategy_for
from gas_lab.dp import default_group
from gas_lab.engine import Engine
from gas_lab.errors import NotImplementedInGasLab
from gas_lab.rules import refusals
from gas_lab.rules.operations import situation_action

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500  # deepspeed.constants'


class DeepSpeedEngine(Engine):
    """:class:`gas_lab.engine.Engine` with DeepSpeed's config, refusals, hooks and bookkeeping.

    Built by :func:`initialize`; ``strategy(params, optimizer, group, max_norm, config)`` is one
    of :func:`~gas_lab.deepspeed_compat.strategies.strategy_for`'s, and builds a
    :class:`~gas_lab.deepspeed_compat.strategies.DeepSpeedStrategy`: every method the engine
    calls on it is named there.

    The engine's state, besides the floor's counters and ``inside_no_sync_ctxt`` /
    ``inside_step`` (:class:`gas_lab.engine.Engine`), each flag with who sets it and who reads it:

    * ``_window_empty``: True from an update until a backward ends (:meth:`after_backward`) or
      coalescing reduces; read by :meth:`check` (an idle rank's ``step()``, appendix A3).
    * ``_boundary_reduced``: managed, the boundary's backward reduced (:meth:`after_backward`,
      coalescing); cleared by :meth:`update`; read by :meth:`check`.
    * ``_boundary_override``: :meth:`set_gradient_accumulation_boundary`'s True/False, or None
      (the counter decides); read by :meth:`is_gradient_accumulation_boundary`.
    * ``_inside_engine_backward``: set during :meth:`backward`, so the output hook
      (:meth:`_on_output_grad`) leaves ``engine.backward()`` alone.
    * ``_direct_backward_seen``: a direct ``loss.backward()`` is running: set by the output
      hook once per pass, cleared when the pass ends (and by :meth:`forward`, after a failed one).
    * ``_step_applied``, ``_lr_kwargs``: the last ``step()``'s outcome and its ``lr_kwargs``,
      from :meth:`step` to :meth:`update` (the scheduler) and :meth:`was_step_applied`.
    """

    strategy: DeepSpeedStrategy

    def __init__(self, module, optimizer, config: GasConfig, group, strategy, device=None):
        super().__init__(
            module,
            optimizer,
            config.gradient_accumulation_steps,
            config.train_micro_batch_size_per_gpu,
            config.managed_gradient_accumulation,
            group=group,
            strategy=functools.partial(strategy, config=config),
            max_norm=config.gradient_clipping,
        )
        self._config = config
        self.precision = precision.route(config)  # where a bf16 run rounds (lesson 08)
        self.skipped_steps = 0  # updates skipped for a non-finite gradient norm
        self.lr_scheduler = None  # set by initialize (lesson 08)
        self.training_dataloader = None  # initialize(training_data=...) (lesson 08)
        self._window_empty = True  # no backward, no reduction since the last update (A3)
        self._boundary_reduced = False  # managed: the boundary micro-step's reduction ran (A3)
        self._boundary_override = None  # set_gradient_accumulation_boundary() (managed only)
        self._inside_engine_backward = False  # the output hooks leave engine.backward() alone
        self._direct_backward_seen = False  # a direct loss.backward() is running
        self._step_applied = False
        self._lr_kwargs = None  # step(lr_kwargs=...), for the scheduler after the update
        # Where this process runs, in DeepSpeed's names (a loop reads them).
        self.global_rank = dist.get_rank() if group is not None else 0
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.dp_world_size = self.world_size
        self.data_parallel_group = group
        self.device = device if device is not None else device_of(module)
        self.mpu = None

    # -- the training loop: the floor's, with DeepSpeed's checks and hooks --------------------
    def forward(self, *inputs, **kwargs):
        out = super().forward(*inputs, **kwargs)
        # A hook on each output sees every backward pass through it start, engine's or not.
        self._direct_backward_seen = False  # (a backward that failed half-way left it set)
        for tensor in _output_tensors(out):
            if tensor.requires_grad:
                tensor.register_hook(self._on_output_grad)
        return out

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        """:meth:`Engine.backward <gas_lab.engine.Engine.backward>`, seen by no output hook."""
        if not (torch.is_tensor(loss) and loss.numel() == 1):
            raise ValueError("engine.backward() expects a scalar loss tensor")
        self.strategy.before_backward()  # bf16 + fp32 accumulation: fresh .grad
        self._inside_engine_backward = True
        try:
            return super().backward(loss, retain_graph, scale_wrt_gas)
        finally:
            self._inside_engine_backward = False

    def after_backward(self) -> None:
        super().after_backward()
        self._window_empty = False
        # The floor reduced if it reduces now: DeepSpeed's ZeRO-1/2 average the window's
        # gradients there, and step() needs that average.
        if self.reduces_now():
            self._boundary_reduced = True

    def _on_output_grad(self, grad):
        """Hook on the model's output: a backward pass reached it. Only a direct
        ``loss.backward()`` gets past the first line: refused at stage 0 (``rules``); at stages 1
        and 2 divided by GAS here, and reduced once autograd has filled every ``.grad``."""
        if self._inside_engine_backward:
            return grad
        if not self._direct_backward_seen:  # once per pass, however many outputs it reaches
            self.check("tensor_backward")
            self._direct_backward_seen = True
            self.strategy.before_backward()
            # Run once this pass ends (DeepSpeed's ZeRO optimizers use the same autograd call).
            torch.autograd.Variable._execution_engine.queue_callback(self._end_direct_backward)
        return grad / self.gas  # what scale_wrt_gas=True does

    def _end_direct_backward(self) -> None:
        self._direct_backward_seen = False
        self.direct_backward_ended()

    def direct_backward_ended(self) -> None:
        """A direct ``loss.backward()`` finished: what follows ``engine.backward()``'s pass
        (at stages 1 and 2 DeepSpeed's gradient hooks see the end of every pass)."""
        self.after_backward()

    def step(self, lr_kwargs=None):
        """:meth:`Engine.step <gas_lab.engine.Engine.step>`, checked. After an applied update
        the LR scheduler steps (``scheduler.step(**lr_kwargs)``); a skipped one (non-finite
        gradient norm) counts in ``skipped_steps`` instead."""
        self.check("step")
        self._step_applied = False
        self._lr_kwargs = lr_kwargs
        super().step()

    def update(self) -> bool:
        self._window_empty, self._boundary_reduced = True, False  # a new window starts
        self._step_applied = super().update()
        if self._step_applied:
            schedules.step_after_update(self.lr_scheduler, self._lr_kwargs, self.train_batch_size())
        else:
            self.skipped_steps += 1
        return self._step_applied

    # -- the boundary, moved or suspended ----------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return super().is_gradient_accumulation_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Managed only: True or False overrides the counter, and it stays overridden until
        set again; None hands the boundary back to the counter (as in DeepSpeed)."""
        self.check("set_boundary_true" if is_boundary else "set_boundary_false")
        self._boundary_override = is_boundary

    @contextlib.contextmanager
    def no_sync(self):
        self.check("enter_no_sync")
        with super().no_sync():
            yield

    @contextlib.contextmanager
    def coalesce_grad_reduction(self):
        """ZeRO-1, managed: the backward() calls of one optimizer step, reduced once.

        Inside the block backward() keeps the gradients local, as inside no_sync(), and step()
        is refused; leaving the block reduces them once, boundary or not (even when left by an
        exception, as in DeepSpeed), and the next boundary step() updates from that. Refused
        unmanaged, at stage 0 and nested, as by DeepSpeed.
        """
        self.check("enter_coalesce")
        try:
            # The floor's no_sync(): this class's would check no_sync()'s own rules.
            with super().no_sync():
                self.strategy.defer_reduction(True)  # ZeRO-2 would reduce inside backward()
                try:
                    yield
                finally:
                    self.strategy.defer_reduction(False)
        finally:  # left by an exception too
            self.strategy.reduce_gradients()
            # Reduced, even if nothing, as the boundary: DeepSpeed then steps.
            self._window_empty, self._boundary_reduced = False, True

    # -- the rules -------------------------------------------------------------------------------
    def check(self, op: str) -> None:
        """Raise what DeepSpeed raises for the engine call ``op`` (an op of
        :data:`gas_lab.rules.operations.CALLS`) in this engine's situation; the teaching mode that
        switches rules off (:mod:`gas_lab.measure.unsafe`) overrides this one method."""
        # An update ahead (unmanaged: every step(); managed: the boundary) from no backward(),
        # or (managed) from a window whose boundary micro-step reduced nothing.
        update = op == "step" and (not self.managed or self.is_gradient_accumulation_boundary())
        situation = refusals.Situation(
            self._config,
            situation_action(op),
            inside_no_sync=self.inside_no_sync_ctxt,
            idle=update and self._window_empty,
            no_boundary_backward=update and self.managed and not self._boundary_reduced,
        )
        refusals.enforce(situation)

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

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def bfloat16_enabled(self) -> bool:
        return self._config.bf16.enabled

    def fp16_enabled(self) -> bool:
        return self._config.fp16.enabled  # always False: initialize refuses fp16

    def steps_per_print(self) -> int | None:
        return self._config.steps_per_print

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm of the last update, before clipping, where DeepSpeed keeps one
        (ZeRO stages 1 and 2); None at stage 0, as in DeepSpeed."""
        return self.strategy.last_norm

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def zero_grad(self) -> None:
        for p in self.module.parameters():
            p.grad = None

    def destroy(self) -> None:
        """Release what the engine attached to the model, as DeepSpeed's ``engine.destroy()``:
        at ZeRO-1 the attributes that expose sharded gradients (at stage 0 nothing is attached).
        The module keeps its trained weights and can be used without the engine."""
        self.strategy.destroy()

    # -- checkpoints (lesson 08): DeepSpeed's two methods, with its signatures, written in
    # gas_lab/deepspeed_compat/checkpoint.py (the engine is their first argument).
    save_checkpoint = checkpoint.save
    load_checkpoint = checkpoint.load


def initialize(
    args=None,
    model=None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    distributed_port=TORCH_DISTRIBUTED_DEFAULT_PORT,
    mpu=None,
    dist_init_required=None,
    collate_fn=None,
    config=None,
    mesh_param=None,
    config_params=None,
    *,
    group=None,
    strategy=None,
):
    """gas_lab's ``deepspeed.initialize``, with DeepSpeed 0.19.8's arguments: ``(engine,
    optimizer, training_dataloader, lr_scheduler)``, the last two None when not asked for.

    The config, as DeepSpeed takes it: ``config`` (a dict, or the path of a JSON file),
    ``config_params`` (DeepSpeed's older name for it) or ``args.deepspeed_config`` (the
    ``--deepspeed_config`` of ``deepspeed.add_config_arguments``); given twice it is refused.
    ``args.local_rank``, if ``args`` has one, is set to the engine's. ``dist_init_required``
    False needs a process group already; ``distributed_port`` is handed to ``deepspeed.comm``,
    which is set up as ``deepspeed.initialize`` sets it up wherever DeepSpeed is installed.
    ``mpu`` and ``mesh_param`` (model and sequence parallelism) are refused: gas_lab is
    data-parallel only.

    ``training_data``: a map-style Dataset; the third value is this rank's loader of
    micro-batches (:mod:`.loader`). ``lr_scheduler``: a scheduler object, or a callable given the
    torch optimizer; it wins over the config's ``scheduler`` block (:mod:`.schedules`).

    gas_lab's own keywords: ``group``, the process group (default:
    :func:`gas_lab.dp.default_group`, the default group or one started from torchrun's
    variables, as DeepSpeed finds it, or none); ``strategy``, how the boundary reduces and
    updates (default: :func:`~gas_lab.deepspeed_compat.strategies.strategy_for` the config's
    ZeRO stage).
    """
    if model is None:
        raise ValueError("initialize() requires a model (DeepSpeed asserts it too)")
    for name, value, instead in (
        ("mpu", mpu, "model parallelism (tensor or pipeline) is DeepSpeed-only"),
        ("mesh_param", mesh_param, "sequence parallelism is DeepSpeed-only"),
    ):
        if value is not None:
            raise NotImplementedInGasLab(
                f"initialize({name}=...): {instead}; gas_lab is data-parallel only. Leave "
                f"{name} out, or use deepspeed.initialize"
            )
    if dist_init_required is False and not dist.is_initialized():
        raise ValueError(
            "dist_init_required=False, but no process group exists: start one "
            "first, or leave dist_init_required out (DeepSpeed asserts the same)"
        )
    group = group if group is not None else default_group()
    if group is not None:
        set_up_deepspeed_comm(distributed_port, dist_init_required)
    world_size = dist.get_world_size(group) if group is not None else 1
    cfg = load_config(read_config(choose_config(args, config, config_params)), world_size)
    pipeline = any(c.__name__ == "PipelineModule" for c in type(model).__mro__)
    refusals.enforce(refusals.Situation(cfg, pipeline=pipeline))
    device = device_for(group, model)
    model.to(device)  # as DeepSpeed does: with nccl, this rank's GPU
    precision.cast_parameters(model, cfg.model_dtype)  # bf16: the weights, not the buffers
    if optimizer is None:  # as in DeepSpeed, a client optimizer wins over the config's
        if cfg.optimizer is None:
            raise NotImplementedInGasLab(
                "gas_lab engines train: give config['optimizer'] or optimizer=..."
            )
        params = model_parameters if model_parameters is not None else model.parameters()
        optimizer = cfg.optimizer.torch_optimizer(params)
    strategy = strategy or strategy_for(cfg.zero_optimization.stage)
    engine = DeepSpeedEngine(model, optimizer, cfg, group, strategy, device)
    if args is not None and hasattr(args, "local_rank"):
        args.local_rank = engine.local_rank  # DeepSpeed aligns it with LOCAL_RANK too
    engine.lr_scheduler = schedules.configure(
        cfg.scheduler, lr_scheduler, engine.optimizer, cfg.zero_optimization.stage
    )
    if training_data is not None:
        rank = dist.get_rank(group) if group is not None else 0
        engine.training_dataloader = loader.training_loader(
            training_data,
            cfg.train_micro_batch_size_per_gpu,
            world_size,
            rank,
            collate_fn,
            cfg.dataloader_drop_last,
        )
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
