"""Reference solutions for lesson 04's exercises (tutorials/04_unmanaged.ipynb).

Both run on every rank: ``python solutions/lesson04.py`` starts 2 CPU ranks and shows both
checkers pass.
"""

from __future__ import annotations


def sample_weighted_losses(losses):
    """Exercise 1: one scalar per micro-batch; every sample of every rank weighs the same."""
    import torch.distributed as dist

    from gas_lab.dp import global_count

    # Samples, not micro-batches: they differ in size. Every rank joins, even with none.
    all_samples = global_count(sum(len(x) for x in losses))
    # DeepSpeed's step() divides the sum over ranks by W: divide by the samples per rank.
    per_rank = all_samples / dist.get_world_size()
    return [x.sum() / per_rank for x in losses]


def rpc_step(engine, micro_batches, loss_fn):
    """Exercise 2: ``hanging_step`` fixed."""
    import torch.distributed as dist

    from gas_lab.dp import global_count

    # Bug 1: the count was all-reduced once per micro-batch, i.e. N times on a rank with N:
    # count once per step, before the loop, on every rank (N = 0 included).
    divisor = global_count(len(micro_batches)) / dist.get_world_size()
    for x, y in micro_batches:
        engine.backward(loss_fn(engine(x), y) / divisor, scale_wrt_gas=False)
    # Bug 2: step() all-reduces the gradients, so a rank with nothing to do must call it too.
    engine.step()


if __name__ == "__main__":
    import gas_lab
    from gas_lab.lessons.exercises.lesson04 import check_rpc_step, check_sample_weights

    cluster = gas_lab.start_cluster(world_size=2, device="cpu")
    print(check_sample_weights(sample_weighted_losses, cluster))
    print(check_rpc_step(rpc_step, cluster))
    cluster.stop()
