"""Reference solutions for lesson 02's exercises (tutorials/02_ddp.ipynb).

Both run on every rank: ``python solutions/lesson02.py`` starts 2 CPU ranks and shows every
checker pass.
"""

from __future__ import annotations


def bucketed_average(grads, bucket_bytes):
    """Exercise 1: average ``grads`` over ranks, one all-reduce per bucket of <= bucket_bytes."""
    import torch
    import torch.distributed as dist

    groups, size = [], bucket_bytes + 1  # size > cap: the first tensor opens a bucket
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if groups and size + nbytes <= bucket_bytes:
            groups[-1].append(g)
            size += nbytes
        else:  # would overflow (or nothing open yet): a new bucket, even if g alone is too big
            groups.append([g])
            size = nbytes
    world = dist.get_world_size()
    for group in groups:
        flat = torch.cat([g.reshape(-1) for g in group])  # a copy: one message per bucket
        dist.all_reduce(flat)
        flat /= world
        for g, piece in zip(group, flat.split([g.numel() for g in group]), strict=True):
            g.copy_(piece.view_as(g))  # ... so the average must be copied back


def train_replicas(steps, n, lr=0.1):
    """Exercise 2: ``drifting_replicas`` with its bug fixed."""
    import torch
    import torch.distributed as dist

    from gas_lab.dp import all_reduce_mean, broadcast_parameters
    from gas_lab.lessons.exercises.lesson02 import SEED
    from gas_lab.toys import flat_params, micro_batch

    rank = dist.get_rank()
    torch.manual_seed(SEED + rank)  # the per-rank seed is fine for the shuffle ...
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    # ... but it also drew each rank's initial weights: start every rank from rank 0's.
    broadcast_parameters(model, dist.group.WORLD)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        for m in torch.randperm(n).tolist():
            x, y = micro_batch(SEED, step, m, rank, 2)
            (torch.nn.functional.mse_loss(model(x), y) / n).backward()
        all_reduce_mean([p.grad for p in model.parameters()], dist.group.WORLD)
        optimizer.step()
        optimizer.zero_grad()
    return flat_params(model)


if __name__ == "__main__":
    import gas_lab
    from gas_lab.lessons.exercises.lesson02 import check_bucketed_average, check_replicas

    cluster = gas_lab.start_cluster(world_size=2, device="cpu")
    print(check_bucketed_average(bucketed_average, cluster))
    print(check_replicas(train_replicas, cluster))
    cluster.stop()
