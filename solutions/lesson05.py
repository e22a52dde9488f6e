"""Reference solutions for lesson 05's exercises (tutorials/05_zero1.ipynb).

Kept apart from the notebook so an instructor can hand out one without the other. Both run on
the ranks: ``python solutions/lesson05.py`` starts 2 ranks and checks both.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def accumulate_shard(micro_grads, group):
    """Exercise 1: my shard of the rank-averaged accumulated gradient, reduced per micro-batch."""
    world = dist.get_world_size(group)
    shard = None
    for g in micro_grads:
        out = torch.empty(g.numel() // world, dtype=g.dtype)
        dist.reduce_scatter_tensor(out, g, group=group)  # shard r of the SUM lands on rank r
        shard = out if shard is None else shard + out  # only a shard is kept between backwards
    return shard / world


def traffic_predictions():
    """Exercise 2: {kind: (calls, bytes)} of each one-step run, on one rank, 2 ranks."""
    return {
        # stage 0, no clipping: the gradient only (58 floats = 232 bytes)
        "A": {"all_reduce": (1, 232)},
        # stage 1: gradient + the 4-byte norm, even without clipping; the padded 60 floats
        "B": {"all_reduce": (2, 236), "all_gather": (1, 240)},
        # 37 weights, padded to 40 (a multiple of 2 x 2): 148 + 4 bytes, all-gather 160
        "C": {"all_reduce": (2, 152), "all_gather": (1, 160)},
        # the reduce-scatter works on the padded buffer too
        "D": {"reduce_scatter": (1, 160), "all_reduce": (1, 4), "all_gather": (1, 160)},
        # a reduce to each owner, of the real elements it owns: [0, 20) and [20, 37) of the 37
        "E": {"reduce": (2, 148), "all_reduce": (1, 4), "all_gather": (1, 160)},
    }


if __name__ == "__main__":
    import gas_lab
    from gas_lab.lessons.exercises.lesson05 import (
        check_shard_accumulation,
        check_traffic_predictions,
    )

    cluster = gas_lab.start_cluster(world_size=2, device="cpu")
    print(check_shard_accumulation(accumulate_shard, cluster))
    print(check_traffic_predictions(traffic_predictions, cluster))
    cluster.stop()
