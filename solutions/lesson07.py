"""Reference solutions for lesson 07's exercises (tutorials/07_capstone.ipynb).

Kept apart from the notebook so an instructor can hand out one without the other.
"""

from __future__ import annotations


def micro_batch_loss(token_losses, mask, rank_tokens, all_tokens, world_size):
    """Exercise 1: the scalar for ``engine.backward(loss, scale_wrt_gas=False)``."""
    # Every real token of the step, on every rank, weighs 1 / all_tokens. DeepSpeed then
    # divides the sum of the ranks' gradients by world_size, which the factor undoes.
    # rank_tokens is a trap: dividing by it weighs the ranks, not the tokens, equally.
    return (token_losses * mask).sum() / all_tokens * world_size


def global_token_count(masks):
    """Exercise 2: on every rank, the real tokens of the step summed over ALL ranks."""
    import torch
    import torch.distributed as dist

    # On the masks' device (a GPU under nccl); called by every rank, even one with no masks.
    mine = sum(int(m.sum()) for m in masks)
    total = torch.tensor([mine], dtype=torch.int64, device=masks[0].device if masks else None)
    dist.all_reduce(total)  # SUM over ranks, in place, on every rank
    return int(total.item())


if __name__ == "__main__":
    from gas_lab.lessons.exercises.lesson07 import check_micro_batch_loss

    print(check_micro_batch_loss(micro_batch_loss))  # exercise 2 needs the notebook's ranks
