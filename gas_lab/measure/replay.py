"""A training loop replayed on either library (``"gas_lab"`` or ``"deepspeed"``; :func:`both`
runs one on each), the ground the measurements of lesson 08 and appendix A2 stand on, and
lesson 08's first: the learning rate at every ``step()`` (:func:`lr_trace`).

A loop is written as a list of *events*, ``("backward", step, micro)`` and ``("step", step)``,
so that a run can stop after any event, save, and continue in a fresh engine from any other
event (:mod:`gas_lab.measure.resume`). Managed, a ``step()`` follows every ``backward()``;
unmanaged, one ``step()`` follows the last ``backward()`` of a window. The notebooks and the
tests call the same functions, so the numbers the notebooks print are the ones the tests check.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gas_lab.measure.parity import initializer
from gas_lab.toys import flat_params, micro_batch, tiny_model


def events(managed: bool, micro_batches: list[int]) -> list[tuple]:
    """The calls of a loop that runs ``micro_batches[s]`` micro-batches in step s."""
    out = []
    for step, n in enumerate(micro_batches):
        for micro in range(n):
            out.append(("backward", step, micro))
            if managed:
                out.append(("step", step))
        if not managed:
            out.append(("step", step))
    return out


def counters(engine) -> dict:
    return {
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
    }


def play(engine, evs, seed: int = 0, lr_kwargs=None, loss_scale: float = 1.0) -> list[dict]:
    """Run the events on this rank; after every ``step()``: the lr, the scheduler's counter
    and the engine's counters. Inputs are cast to the model's dtype (bf16 engines)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    size = engine.train_micro_batch_size_per_gpu()
    dtype = next(engine.module.parameters()).dtype
    trace = []
    for kind, step, *micro in evs:
        if kind == "backward":
            x, y = micro_batch(seed, step, micro[0], rank, size)
            loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
            engine.backward(loss * loss_scale)
        else:
            engine.step(lr_kwargs=lr_kwargs(step) if callable(lr_kwargs) else lr_kwargs)
            sched = engine.lr_scheduler
            trace.append(
                {
                    "lr": engine.get_lr()[0],
                    "applied": engine.was_step_applied(),
                    "last_batch_iteration": getattr(sched, "last_batch_iteration", None),
                    **counters(engine),
                }
            )
    return trace


def quiet_initializer(lib: str):
    """``initializer(lib)``, with DeepSpeed's logging quieted *after* its import (which sets
    its logger's level): no progress, memory or 'scheduler not started' lines."""
    import logging

    init = initializer(lib)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    return init


def build(lib: str, config: dict, seed: int = 0, **kw):
    """A fresh engine of ``lib`` on ``tiny_model(seed)`` (``model=`` to pass another)."""
    model = kw.pop("model", None) or tiny_model(seed)
    init = quiet_initializer(lib)
    return init(model=model, model_parameters=model.parameters(), config=config, **kw)


LIBS = ("gas_lab", "deepspeed")


def both(measure, *args, **kwargs) -> dict:
    """``{lib: measure(lib, *args, **kwargs)}`` for gas_lab and DeepSpeed, in that order (the
    same order on every rank): one measurement, run on each engine."""
    return {lib: measure(lib, *args, **kwargs) for lib in LIBS}


def lr_trace(lib: str, config: dict, micro_batches: list[int], lr_kwargs=None) -> dict:
    """The lr and counters after every ``step()`` of a loop, and the lr before the first."""
    engine, *_ = build(lib, config)
    before = engine.get_lr()[0]
    managed = engine.managed_gradient_accumulation()
    trace = play(engine, events(managed, micro_batches), lr_kwargs=lr_kwargs)
    return {"lr_at_start": before, "trace": trace, "params": flat_params(engine.module)}


class RecordingSGD(torch.optim.SGD):
    """SGD with lr 0 that keeps the gradient it is handed at each step (the parameters it
    sees: fp32 masters or a ZeRO shard, whatever the engine gives its optimizer)."""

    def step(self, closure=None):
        self.seen = torch.cat(
            [
                p.grad.detach().double().reshape(-1)
                for g in self.param_groups
                for p in g["params"]
                if p.grad is not None
            ]
        )
        return super().step(closure)


DIMS = {"d_in": 16, "hidden": 64, "d_out": 8}  # a model with a few thousand weights
