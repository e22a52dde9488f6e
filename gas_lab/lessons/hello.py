"""Hello, ranks: the smallest distributed programs, used by tutorial 00 and its script.

Each function runs *on every rank* (inside ``cluster.run`` in a notebook, or under
``torchrun`` in ``tutorials/scripts/hello_ranks.py``) and expects the default process group
to be initialized already.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gas_lab.toys import flat_params, micro_batch, tiny_model


def all_reduce_hello() -> dict:
    """Every rank contributes ``rank + 1``; after ``all_reduce`` every rank holds the sum."""
    # nccl moves GPU tensors only; gloo moves CPU tensors.
    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    mine = torch.tensor([dist.get_rank() + 1.0], device=device)
    total = mine.clone()
    dist.all_reduce(total)  # default op: SUM, result lands on every rank
    return {"rank": dist.get_rank(), "sent": mine.item(), "received": total.item()}


def zero1_config(micro_batch: int = 4, gas: int = 2) -> dict:
    """A ZeRO stage 1 DeepSpeed config small enough to train in a second on a CPU."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": gas,
        # PyTorch's Adam instead of DeepSpeed's fused one, which would JIT-compile C++ first.
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,  # keep the notebook output for what we print ourselves
    }


def train_tiny_deepspeed(steps: int = 3, seed: int = 0, config: dict | None = None) -> dict:
    """Train ``tiny_model`` with ``deepspeed.initialize``; return this rank's parameters (one
    flat tensor) and the engine's counters. ``micro_batch(seed, step, m, rank, size)`` is
    rank's own fixed data, which one process can rebuild for every rank."""
    import deepspeed

    config = config or zero1_config()
    model = tiny_model(seed)  # same seed on every rank -> same initial weights
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    rank, size = dist.get_rank(), engine.train_micro_batch_size_per_gpu()
    for step in range(steps):
        for m in range(engine.gradient_accumulation_steps()):
            x, y = (t.to(engine.device) for t in micro_batch(seed, step, m, rank, size))
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()  # applies an update only on the accumulation boundary
    return {
        "rank": rank,
        "params": flat_params(engine.module),
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps,
        "loss": loss.item(),
    }
