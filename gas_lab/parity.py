"""Run the same training loop on gas_lab and on DeepSpeed, and compare.

Same model (built from the same seed), same data (drawn from (seed, step, micro-batch, rank)),
same config, same loop; afterwards the parameters, the counters after every ``step()`` and the
collectives issued are compared. Call it on every rank (it performs collectives)::

    result = run_parity(config, steps=3)
    assert result.max_abs_diff <= 1e-6 and result.counters_equal

:func:`check_rule` does the same for refusals: it runs a rule's example on both libraries and
returns what each raised.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gas_lab import engine as gas_engine
from gas_lab import rules
from gas_lab.comm import count_collectives

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


def tiny_model(seed: int, in_features: int = 4, hidden: int = 8, out_features: int = 2):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(in_features, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, out_features)
    )


def micro_batch(seed: int, step: int, micro: int, rank: int, size: int, in_f=4, out_f=2):
    """Deterministic data: every (seed, step, micro-batch, rank) has its own fixed sample."""
    g = torch.Generator().manual_seed(((seed * 1000 + step) * 1000 + micro) * 1000 + rank)
    return torch.randn(size, in_f, generator=g), torch.randn(size, out_f, generator=g)


def ensure_process_group() -> None:
    """DeepSpeed needs a process group; outside a launcher, make a 1-process gloo group."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        else:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    # DeepSpeed reads the launcher's variables even when the group already exists.
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank() % max(torch.cuda.device_count(), 1)))
    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))


def train(
    initialize: Callable,
    config: dict,
    steps: int,
    micro_batches: Sequence[int] | Callable[[int, int], int] | None = None,
    scale_wrt_gas: bool = True,
    seed: int = 0,
    model_fn: Callable[[int], torch.nn.Module] = tiny_model,
    loss_divisor: Callable[[int], float] | None = None,
):
    """Train with ``initialize`` (gas_lab's or DeepSpeed's).

    Returns (engine, counters after every step(), micro-batch losses, CollectiveLog of the loop).

    ``micro_batches``: how many micro-batches make step i: None (gradient_accumulation_steps),
    a list (one number per step) or ``f(step, rank)`` (ranks may differ, unmanaged only).
    Managed, ``step()`` follows every micro-batch; unmanaged, it follows the last one.
    ``loss_divisor(n)``, if given, is called once per step with this rank's n, before the first
    backward (it may all-reduce), and every micro-batch loss of the step is divided by it.
    """
    model = model_fn(seed)
    engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(), config=config)
    rank = dist.get_rank() if dist.is_initialized() else 0
    size = engine.train_micro_batch_size_per_gpu()
    managed = engine.managed_gradient_accumulation()
    counters, losses = [], []
    with count_collectives() as log:  # the loop only: initialize's broadcasts are not counted
        for step in range(steps):
            n = micro_batches_in(micro_batches, step, rank, engine.gradient_accumulation_steps())
            divisor = 1.0 if loss_divisor is None else loss_divisor(n)
            for micro in range(n):
                x, y = micro_batch(seed, step, micro, rank, size)
                loss = torch.nn.functional.mse_loss(engine(x), y)
                engine.backward(loss / divisor, scale_wrt_gas=scale_wrt_gas)
                losses.append(loss.item())
                if managed:
                    engine.step()
                    counters.append(_counters(engine))
            if not managed:
                engine.step()
                counters.append(_counters(engine))
    return engine, counters, losses, log


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
    ensure_process_group()
    import deepspeed  # imported late: it is slow to import and needs DS_ACCELERATOR set

    return deepspeed.initialize


def run_parity(config: dict, steps: int = 3, **kw) -> ParityResult:
    """Train on gas_lab, then on DeepSpeed, from the same seed; compare (on every rank)."""
    ds_init = deepspeed_initialize()
    engines, counters, losses, collectives = {}, {}, {}, {}
    for name, init in (("gas_lab", gas_engine.initialize), ("deepspeed", ds_init)):
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


def check_rule(rule: rules.Rule, base: dict | None = None) -> dict[str, BaseException | None]:
    """Run ``rule.example`` on gas_lab and on DeepSpeed; return what each raised (or None)."""
    config = rules.example_config(rule, base or BASE_CONFIG)
    out = {}
    for name, init in (("gas_lab", gas_engine.initialize), ("deepspeed", deepspeed_initialize())):
        try:
            _trigger(init, config, rule.example)
            out[name] = None
        except Exception as err:  # the point is to catch and compare whatever is raised
            out[name] = err
    return out


def _trigger(initialize, config, example: rules.Example) -> None:
    if example.pipeline:
        from deepspeed.pipe import PipelineModule

        model = PipelineModule(layers=list(tiny_model(0)), num_stages=1, loss_fn=torch.nn.MSELoss())
    else:
        model = tiny_model(0)
    engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(), config=config)
    x, y = micro_batch(0, 0, 0, 0, engine.train_micro_batch_size_per_gpu())
    if example.action == "set_boundary":
        engine.set_gradient_accumulation_boundary(True)
    elif example.action == "coalesce":
        with engine.coalesce_grad_reduction():
            pass
    elif example.action == "step_in_no_sync":
        with engine.no_sync():
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
    elif example.action == "no_sync_twice":
        with engine.no_sync(), engine.no_sync():
            pass
    elif example.action == "coalesce_in_no_sync":
        with engine.no_sync(), engine.coalesce_grad_reduction():
            pass
    elif example.action == "tensor_backward":
        torch.nn.functional.mse_loss(engine(x), y).backward()
    elif example.action != "initialize":
        raise ValueError(f"unknown example action {example.action!r}")
