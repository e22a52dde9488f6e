"""Run the same training loop on gas_lab and on DeepSpeed, and compare.

Same model (built from the same seed), same data (drawn from (seed, step, micro-batch, rank)),
same config, same loop; afterwards the parameters, the counters after every ``step()`` and the
collectives issued are compared. Call it on every rank (it performs collectives)::

    result = run_parity(config, steps=3)
    assert result.max_abs_diff <= 1e-6 and result.counters_equal
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gas_lab.deepspeed_compat.config import load_config
from gas_lab.deepspeed_compat.engine import initialize as gas_initialize
from gas_lab.dp import init_from_env
from gas_lab.measure.comm import Phase, count_collectives
from gas_lab.toys import flat_params, micro_batch, tiny_model

# A working base config for examples: tiny batches, Adam from torch (no fused-Adam JIT build).
BASE_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
}


@dataclass
class ParityResult:
    max_abs_diff: float  # over all parameters, after training
    per_parameter: dict[str, float]
    counters: dict[str, list[tuple]]  # engine -> after every step(): (global_steps,
    # global_samples, micro_steps, was_step_applied)
    collectives: dict[str, dict[str, dict[str, int]]]  # engine -> kind -> {calls, bytes},
    # issued by the training loop (not by initialize)
    losses: dict[str, list[float]] = field(default_factory=dict)

    @property
    def counters_equal(self) -> bool:
        return self.counters["gas_lab"] == self.counters["deepspeed"]

    def ok(self, tol: float = 1e-6) -> bool:
        return self.max_abs_diff <= tol and self.counters_equal


def train(
    initialize: Callable,
    config: dict,
    steps: int,
    micro_batches: Sequence[int] | Callable[[int, int], int] | None = None,
    scale_wrt_gas: bool = True,
    seed: int = 0,
    model_fn: Callable[[int], torch.nn.Module] = tiny_model,
    loss_divisor: Callable[[int], float] | None = None,
    phases: list | None = None,
):
    """Train with ``initialize`` (gas_lab's or DeepSpeed's).

    Returns (engine, counters after every step(), micro-batch losses, CollectiveLog of the loop).

    ``micro_batches``: how many micro-batches make step i: None (gradient_accumulation_steps),
    a list (one number per step) or ``f(step, rank)`` (ranks may differ, unmanaged only).
    Managed, ``step()`` follows every micro-batch; unmanaged, it follows the last one.
    ``loss_divisor(n)``, if given, is called once per step with this rank's n, before the first
    backward (it may all-reduce), and every micro-batch loss of the step is divided by it.
    ``phases``, if a list, receives a :class:`~gas_lab.measure.comm.Phase` (the collectives)
    for initialize and for every forward, backward and step() call, in order.
    """
    model = model_fn(seed)
    with _phase(phases, "initialize", -1, None):
        engine, _, _, _ = initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    size = engine.train_micro_batch_size_per_gpu()
    managed = engine.managed_gradient_accumulation()
    counters, losses = [], []
    # the loop only: initialize's broadcasts are not counted.
    with count_collectives() as log, quiet_deepspeed():
        for step in range(steps):
            n = micro_batches_in(micro_batches, step, rank, engine.gradient_accumulation_steps())
            divisor = 1.0 if loss_divisor is None else loss_divisor(n)
            for micro in range(n):
                x, y = micro_batch(seed, step, micro, rank, size)
                with _phase(phases, "forward", step, micro):
                    out = engine(x)
                loss = torch.nn.functional.mse_loss(out, y)
                with _phase(phases, "backward", step, micro):
                    engine.backward(loss / divisor, scale_wrt_gas=scale_wrt_gas)
                losses.append(loss.item())
                if managed:
                    with _phase(phases, "step", step, micro):
                        engine.step()
                    counters.append(_counters(engine))
            if not managed:
                with _phase(phases, "step", step, None):
                    engine.step()
                counters.append(_counters(engine))
    return engine, counters, losses, log


@contextlib.contextmanager
def quiet_deepspeed():
    """DeepSpeed 0.19.8's ZeRO-2/3 call torch.distributed names that torch 2.13 deprecates; that
    FutureWarning (with this machine's paths) is about DeepSpeed's code, not the learner's, so
    it is not shown inside this block."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
        )
        yield


@contextlib.contextmanager
def _phase(phases: list | None, what: str, step: int, micro: int | None):
    """Record the block's collectives as one Phase in ``phases`` (nothing when None)."""
    if phases is None:
        yield
        return
    with count_collectives() as log:
        yield
    phases.append(Phase(what, step, micro, log.calls))


def micro_batches_in(micro_batches, step: int, rank: int, default: int) -> int:
    """How many micro-batches ``rank`` runs in ``step``, from ``train``'s three spellings."""
    if micro_batches is None:
        return default
    if callable(micro_batches):
        return micro_batches(step, rank)
    return micro_batches[step]


def _counters(engine) -> tuple:
    return (
        engine.global_steps,
        engine.global_samples,
        engine.micro_steps,
        engine.was_step_applied(),
    )


def deepspeed_initialize():
    """``deepspeed.initialize``, after joining (or making) the process group DeepSpeed needs."""
    init_from_env()
    import deepspeed  # imported late: it is slow to import and needs DS_ACCELERATOR set

    return deepspeed.initialize


LIBRARIES = ("gas_lab", "deepspeed")


def initializer(library: str) -> Callable:
    """The ``initialize`` of ``library``: ``"gas_lab"`` or ``"deepspeed"`` (call it on a rank).

    Lessons write one loop and run it on both: ``initializer(lib)(model=..., config=...)``.
    """
    if library not in LIBRARIES:
        raise ValueError(f"library {library!r}: choose from {LIBRARIES}")
    return gas_initialize if library == "gas_lab" else deepspeed_initialize()


def run_parity(config: dict, steps: int = 3, **kw) -> ParityResult:
    """Train on gas_lab, then on DeepSpeed, from the same seed; compare (on every rank)."""
    ds_init = deepspeed_initialize()
    engines, counters, losses, collectives = {}, {}, {}, {}
    for name, init in (("gas_lab", gas_initialize), ("deepspeed", ds_init)):
        engines[name], counters[name], losses[name], log = train(init, config, steps, **kw)
        collectives[name] = log.by_kind()
    ours = dict(engines["gas_lab"].module.named_parameters())
    theirs = dict(engines["deepspeed"].module.named_parameters())
    per_parameter = {k: (ours[k] - theirs[k]).abs().max().item() for k in ours}
    return ParityResult(
        max_abs_diff=max(per_parameter.values()),
        per_parameter=per_parameter,
        counters=counters,
        collectives=collectives,
        losses=losses,
    )


def reference_params(
    config: dict,
    steps: int,
    micro_batches: Sequence[int] | Callable[[int, int], int] | None = None,
    world_size: int = 2,
    clip: float = 0.0,
    seed: int = 0,
    grad_norms: list[float] | None = None,
    skip_empty: bool = False,
) -> torch.Tensor:
    """Single process, no engine: the parameters a correct loop ends with (returned flat).

    Each step takes every micro-batch every rank would run (``micro_batches`` as in
    ``parity.train``), averages the loss over all of their samples (every sample weighs the
    same), clips at ``clip`` if it is > 0, and takes one step of the optimizer the config
    names, built as DeepSpeed builds it (type "Adam" is AdamW; without ``torch_adam``,
    FusedAdam's defaults: :mod:`gas_lab.deepspeed_compat.optimizers`). Runs anywhere; no collectives.
    If ``grad_norms`` is a list, each step's gradient norm (before clipping) is appended to it.
    A step without data anywhere steps on zero gradients, as DeepSpeed's engines do (stage 0),
    or, with ``skip_empty``, does not update (a loop that skips it: lesson 07).
    """
    cfg = load_config(config, world_size=world_size)
    model = tiny_model(seed)
    optimizer = cfg.optimizer.torch_optimizer(model.parameters())
    size = cfg.train_micro_batch_size_per_gpu
    for step in range(steps):
        pairs = [
            micro_batch(seed, step, m, rank, size)
            for rank in range(world_size)
            for m in range(
                micro_batches_in(micro_batches, step, rank, cfg.gradient_accumulation_steps)
            )
        ]
        if not pairs and skip_empty:
            continue
        if not pairs:
            # No data anywhere: the engines still step, with zero gradients.
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        else:
            x, y = (torch.cat(t) for t in zip(*pairs, strict=True))
            torch.nn.functional.mse_loss(model(x), y).backward()
        # max_norm inf: only measure. torch's clip scales by max_norm / (norm + 1e-6), as DeepSpeed.
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else math.inf)
        if grad_norms is not None:
            grad_norms.append(norm.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return flat_params(model)
