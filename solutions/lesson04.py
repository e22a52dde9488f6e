"""Reference solutions for lesson 04's exercises (tutorials/04_unmanaged.ipynb).

Exercise 2 runs on every rank: ``python solutions/lesson04.py`` starts 2 CPU ranks and shows
every checker pass.
"""

from __future__ import annotations


def rpc_step(engine, micro_batches, loss_fn):
    """Exercise 1: N backward() calls, then one step(), on an unmanaged engine."""
    n = len(micro_batches)
    for x, y in micro_batches:
        # The engine would divide by its configured GAS; this step has N micro-batches.
        engine.backward(loss_fn(engine(x), y) / n, scale_wrt_gas=False)
    engine.step()  # unmanaged: this call is the boundary (all-reduce, then update)


def loss_divisor(n):
    """Exercise 2: the same divisor on every rank, from every rank's count."""
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(n)])
    dist.all_reduce(total)  # every rank joins, even with n == 0
    # The engine averages the ranks' gradients (divides by the world size), so divide by the
    # average count per rank: then every micro-batch, on any rank, weighs 1 / total.
    return total.item() / dist.get_world_size()


if __name__ == "__main__":
    import gas_lab
    from gas_lab.lessons.exercises.lesson04 import check_loss_divisor, check_rpc_step

    print(check_rpc_step(rpc_step))
    cluster = gas_lab.start_cluster(world_size=2)
    print(check_loss_divisor(loss_divisor, cluster))
    cluster.stop()
