"""Reference solutions for lesson 01's exercises (tutorials/01_single_device.ipynb).

Kept apart from the notebook so an instructor can hand out one without the other. Run
``python solutions/lesson01.py`` to see every checker pass.
"""

from __future__ import annotations

import torch


def token_mean_stream(model, stream, loss_fn):
    """Exercise 1: the window's per-token gradient, its token count known only at the end."""
    model.zero_grad()
    n_tokens = 0
    for mb in stream:
        # The SUM of the real-token losses: no count is needed yet ...
        (loss_fn(model, mb) * mb.mask).sum().backward()
        n_tokens += int(mb.mask.sum())
    # ... because d(sum / T) = d(sum) / T: divide the accumulated gradient once, at the end.
    for p in model.parameters():
        if p.grad is not None:
            p.grad /= n_tokens


def clipped_step(model, optimizer, micro_batches, loss_fn, max_norm):
    """Exercise 2: ``buggy_clipped_step`` with both bugs fixed."""
    optimizer.zero_grad()
    total = sum(len(mb) for mb in micro_batches)
    for mb in micro_batches:
        # Bug 1 fixed: weigh each micro-batch's mean by its share of the samples, not 1/N.
        (loss_fn(model, mb).mean() * len(mb) / total).backward()
    # Bug 2 fixed: clip the accumulated gradient once, not every partial sum.
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()


if __name__ == "__main__":
    from gas_lab.lessons.exercises.lesson01 import check_clipped_step, check_token_mean_stream

    print(check_token_mean_stream(token_mean_stream))
    print(check_clipped_step(clipped_step))
