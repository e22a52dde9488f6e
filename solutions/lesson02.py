"""Reference solutions for lesson 02's exercises (tutorials/02_ddp.ipynb).

Exercises 1 and 2 run on every rank, so their checkers need the ranks: run
``python solutions/lesson02.py`` to start 2 CPU ranks and see every checker pass.
"""

from __future__ import annotations


def average_gradients(model):
    """Exercise 1: replace every gradient by its average over ranks."""
    import torch.distributed as dist

    world = dist.get_world_size()
    for p in model.parameters():
        dist.all_reduce(p.grad)  # sum over ranks, in place, on every rank
        p.grad /= world  # gloo has no AVG, and a mean is what keeps the step size


def ddp_accumulation_step(model, optimizer, micro_batches, loss_fn):
    """Exercise 2: one optimizer step over the micro-batches, one all-reduce, with torch DDP."""
    import contextlib

    n = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        # DDP decides in forward() whether the coming backward() reduces: wrap both.
        with model.no_sync() if i < n - 1 else contextlib.nullcontext():
            loss = loss_fn(model(x), y) / n
            loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def gas_for(global_batch, micro, world_size):
    """Exercise 3: the batch invariant global = micro x GAS x world, solved for GAS."""
    gas, rest = divmod(global_batch, micro * world_size)
    if rest or gas < 1:
        raise ValueError(
            f"{global_batch} is not a positive multiple of micro x world = {micro * world_size}"
        )
    return gas


if __name__ == "__main__":
    import gas_lab
    from gas_lab.lessons.exercises.lesson02 import (
        check_average_gradients,
        check_ddp_accumulation_step,
        check_gas_for,
    )

    cluster = gas_lab.start_cluster(world_size=2)
    print(check_average_gradients(average_gradients, cluster))
    print(check_ddp_accumulation_step(ddp_accumulation_step, cluster))
    print(check_gas_for(gas_for))
    cluster.stop()
