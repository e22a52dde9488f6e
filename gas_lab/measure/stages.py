"""What each ZeRO stage sends and holds, measured on a rank (lesson 09).

Every function runs on *every* rank (inside ``cluster.run``), on gas_lab or on DeepSpeed
(``library``), with the deterministic data of :mod:`gas_lab.toys`:

* :func:`traffic`: the collectives of every call of a training loop, and the bytes of each
  optimizer step after a warm-up (ZeRO-3 checks its parameter-fetch schedule on the first two);
* :func:`held_memory`: a rank's bytes by category (:func:`gas_lab.measure.memory.census`) in the
  middle of an accumulation window, when a gradient is held (appendix A5);
* :func:`config`: the lesson's DeepSpeed config for a stage.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gas_lab.measure.comm import bytes_per_step
from gas_lab.measure.memory import census
from gas_lab.measure.parity import initializer, quiet_deepspeed, train
from gas_lab.toys import micro_batch, tiny_model

ADAM = {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}
WARMUP = 2  # optimizer steps before traffic is counted as steady


def config(stage: int, managed: bool = True, gas: int = 4, **extra) -> dict:
    """Adam (torch's AdamW), micro-batches of 2, ``gas`` micro-batches per step when managed."""
    zero = {"stage": stage, **extra.pop("zero_optimization", {})}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "managed_gradient_accumulation": managed,
        "optimizer": ADAM,
        "zero_optimization": zero,
        **extra,
    }


def traffic(library: str, cfg: dict, ns=None, model_fn=tiny_model) -> dict:
    """Train ``WARMUP`` steps of one micro-batch, then one step per entry of ``ns`` (None:
    ``ns`` = [GAS], managed). Returns ``{"phases": [Phase, ...], "per_step": bytes of each
    counted step, "ring": the same under the ring model, "n": the micro-batches of each}``."""
    managed = cfg.get("managed_gradient_accumulation", True)
    gas = cfg["gradient_accumulation_steps"]
    counted = [gas] if ns is None else list(ns)
    plan = ([gas] if managed else [1]) * WARMUP + counted
    phases: list = []
    train(
        initializer(library),
        cfg,
        len(plan),
        None if managed else plan,
        phases=phases,
        model_fn=model_fn,
    )
    world = dist.get_world_size() if dist.is_initialized() else 1
    return {
        "phases": phases,
        "per_step": bytes_per_step(phases)[WARMUP:],
        "ring": bytes_per_step(phases, ring=world)[WARMUP:],
        "n": counted,
    }


def held_memory(library: str, cfg: dict, model_fn=tiny_model, paths=None) -> dict[str, int]:
    """One optimizer step (so the optimizer state exists), then one more micro-batch's
    forward and backward: the census while a gradient is held, before the next ``step()``
    (``paths``: see :func:`gas_lab.measure.memory.census`). Inputs are cast to the model's
    dtype (bf16 engines)."""
    model = model_fn(0)
    engine = initializer(library)(model=model, model_parameters=model.parameters(), config=cfg)[0]
    rank = dist.get_rank() if dist.is_initialized() else 0
    size, dtype = engine.train_micro_batch_size_per_gpu(), next(engine.module.parameters()).dtype
    managed = engine.managed_gradient_accumulation()

    def backward(step: int, micro: int) -> None:
        x, y = micro_batch(0, step, micro, rank, size)
        engine.backward(torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y))

    with quiet_deepspeed():
        for micro in range(engine.gradient_accumulation_steps()):
            backward(0, micro)
            if managed:
                engine.step()
        if not managed:
            engine.step()
        backward(1, 0)
    return census(engine, paths=paths)
