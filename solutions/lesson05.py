"""Reference solutions for lesson 05's exercises (tutorials/05_zero1.ipynb).

Kept apart from the notebook so an instructor can hand out one without the other. Exercises 2
and 3 run on every rank: ``python solutions/lesson05.py`` starts 2 ranks and checks all three.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def shard_range(numel, world_size, rank):
    """Exercise 1: [start, end) of rank's shard of the zero-padded flat vector."""
    unit = 2 * world_size  # shard sizes a multiple of 2 elements, as DeepSpeed aligns them
    padded = -(-numel // unit) * unit  # round UP, so that no real element is left over
    size = padded // world_size
    return rank * size, (rank + 1) * size


def global_grad_norm(shard, group):
    """Exercise 2: the norm of the whole gradient, from this rank's shard of it."""
    squares = shard.float().pow(2).sum()  # squares add up over ranks; norms do not
    dist.all_reduce(squares, group=group)
    return squares.sqrt().item()


def gradient_shard(flat_grad, group):
    """Exercise 3: this rank's shard of the gradient averaged over ranks."""
    world = dist.get_world_size(group)
    out = torch.empty(flat_grad.numel() // world, dtype=flat_grad.dtype)
    dist.reduce_scatter_tensor(out, flat_grad, group=group)  # shard r of the SUM, on rank r
    return out / world


if __name__ == "__main__":
    import gas_lab
    from gas_lab.lessons.exercises.lesson05 import (
        check_global_norm,
        check_gradient_shard,
        check_shard_ranges,
    )

    cluster = gas_lab.start_cluster()
    print(check_shard_ranges(shard_range))
    print(check_global_norm(global_grad_norm, cluster))
    print(check_gradient_shard(gradient_shard, cluster))
    cluster.stop()
