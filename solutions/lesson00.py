"""Solution to lesson 00's exercise."""


def mean_across_ranks(x):
    import torch.distributed as dist

    total = x.clone()
    dist.all_reduce(total)  # SUM over ranks, in place, on every rank
    return total / dist.get_world_size()
