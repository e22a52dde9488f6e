"""What each ZeRO stage sends and holds, measured on a rank (lesson 09).

Every function runs on *every* rank (inside ``cluster.run``), on gas_lab or on DeepSpeed
(``library``), with the deterministic data of :mod:`gas_lab.toys`:

* :func:`traffic`: the collectives of every call of a training loop, and the bytes of each
  optimizer step after a warm-up (ZeRO-3 checks its parameter-fetch schedule on the first two);
* :func:`held_memory`: a rank's bytes by category (:func:`gas_lab.measure.memory.census`) in the
  middle of an accumulation window, when a gradient is held (appendix A5);
* :func:`division`: what a rank hands to the gradient's reduction, as a fraction of its local
  gradient: 1/W when the division by W comes before the sum, 1 when it comes after (lesson 05);
* :func:`config`: the lesson's DeepSpeed config for a stage.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

from gas_lab.measure.comm import bytes_per_step
from gas_lab.measure.memory import census
from gas_lab.measure.parity import initializer, quiet_deepspeed, train
from gas_lab.toys import flat_params, micro_batch, tiny_model

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
    train(initializer(library), cfg, len(plan), None if managed else plan, phases=phases,
          model_fn=model_fn)  # fmt: skip
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


# -- where the division by W happens (lesson 05) -------------------------------------------------
REDUCTIONS = ("all_reduce", "reduce")


@contextlib.contextmanager
def handed_to_reductions():
    """Copies of the tensor handed to every ``torch.distributed`` all_reduce and reduce inside
    the block, taken *before* the call: what this rank puts into the sum. Yields a list of
    ``(function name, tensor)``, filled as the calls happen (DeepSpeed reaches the same
    functions through ``deepspeed.comm``)."""
    handed: list[tuple[str, torch.Tensor]] = []
    originals = {name: getattr(dist, name) for name in REDUCTIONS}

    def wrapped(name, original):
        @functools.wraps(original)
        def call(*args, **kwargs):
            tensor = kwargs["tensor"] if "tensor" in kwargs else args[0]
            handed.append((name, tensor.detach().clone()))
            return original(*args, **kwargs)

        return call

    for name, original in originals.items():
        setattr(dist, name, wrapped(name, original))
    try:
        yield handed
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def local_gradient(n: int, seed: int = 0, model_fn=tiny_model) -> torch.Tensor:
    """This rank's own gradient of one optimizer step of ``n`` micro-batches (each loss / n),
    flat, from a plain copy of the model: no engine, no communication."""
    model = model_fn(seed)
    rank = dist.get_rank() if dist.is_initialized() else 0
    for micro in range(n):
        x, y = micro_batch(seed, 0, micro, rank, 2)
        (torch.nn.functional.mse_loss(model(x), y) / n).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def division(library: str, cfg: dict, n: int = 2) -> dict:
    """One unmanaged optimizer step of ``n`` micro-batches on ``library`` at ZeRO stage 0 or 1
    (one reduction of the whole step's gradient); what the rank hands to that reduction (the
    1-element norm left out).

    Returns ``{"calls": [(function, bytes), ...], "sent": s, "params": flat parameters}``, where
    the handed tensors, laid end to end, are ``s`` x this rank's local gradient: ``1 / W`` when
    the library divides by the world size before the sum, ``1.0`` when it divides after.
    """
    stage = cfg["zero_optimization"]["stage"]
    if stage > 1:
        raise ValueError(
            f"zero_optimization.stage {stage}: reduces every backward, not once a step"
        )
    cfg = {**cfg, "managed_gradient_accumulation": False}
    model = tiny_model(0)
    engine = initializer(library)(model=model, model_parameters=model.parameters(), config=cfg)[0]
    rank = dist.get_rank()
    with quiet_deepspeed(), handed_to_reductions() as handed:
        for micro in range(n):
            x, y = micro_batch(0, 0, micro, rank, engine.train_micro_batch_size_per_gpu())
            loss = torch.nn.functional.mse_loss(engine(x), y) / n
            engine.backward(loss, scale_wrt_gas=False)
        engine.step()
    grads = [(name, t) for name, t in handed if t.numel() > 1]  # not the 4-byte norm
    sent = torch.cat([t.reshape(-1).float() for _, t in grads])
    local = local_gradient(n)
    if sent.numel() != local.numel():
        raise RuntimeError(
            f"{library} reduced {sent.numel()} elements; the model has {local.numel()}"
        )
    scale = (sent @ local / (local @ local)).item()
    if not torch.allclose(sent, scale * local, rtol=1e-5, atol=1e-8):
        raise RuntimeError(f"{library} reduced something other than a multiple of its gradient")
    return {
        "calls": [(name, t.numel() * t.element_size()) for name, t in grads],
        "sent": scale,
        "params": flat_params(engine.module),
    }
