"""Solutions to lesson 00's exercises (tutorials/00_setup.ipynb).

Both run on every rank: ``python solutions/lesson00.py`` starts 2 CPU ranks and shows both
checkers pass.
"""


def gather_ragged(x):
    """Exercise 1: every rank's 1-D tensor, rank 0's first, on every rank; lengths may differ."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    # all_gather moves equal-sized tensors only: agree on the lengths first ...
    length = torch.tensor([x.numel()])
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length)
    lengths = [int(n) for n in lengths]
    # ... then send everyone's values padded to the longest, and cut the padding off again.
    padded = torch.zeros(max(lengths), dtype=x.dtype)
    padded[: x.numel()] = x
    pieces = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(pieces, padded)
    return torch.cat([piece[:n] for piece, n in zip(pieces, lengths, strict=True)])


def any_rank_overflowed(loss):
    """Exercise 2: True on every rank if any rank's loss is inf or nan, else False everywhere."""
    import math

    import torch
    import torch.distributed as dist

    # A 0/1 flag, not the loss: two finite losses near float32's maximum sum to inf.
    flag = torch.tensor([0.0 if math.isfinite(loss) else 1.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # 1 on every rank as soon as one rank has 1
    return bool(flag.item())


if __name__ == "__main__":
    import gas_lab
    from gas_lab.lessons.exercises.lesson00 import check_any_rank_overflowed, check_gather_ragged

    cluster = gas_lab.start_cluster(world_size=2, device="cpu")
    print(check_gather_ragged(gather_ragged, cluster))
    print(check_any_rank_overflowed(any_rank_overflowed, cluster))
    cluster.stop()
