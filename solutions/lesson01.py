"""Reference solutions for lesson 01's exercises (tutorials/01_single_device.ipynb).

Kept apart from the notebook so an instructor can hand out one without the other. Run
``python solutions/lesson01.py`` to see every checker pass.
"""

from __future__ import annotations


def accumulation_loop(model, micro_batches, loss_fn):
    """Exercise 1: leave the full-batch mean-loss gradient in each parameter's ``.grad``."""
    n = len(micro_batches)
    model.zero_grad()  # once, before the loop: stale gradients from a previous step go away
    for mb in micro_batches:
        # mean over this micro-batch, / N so the N backward() calls add up to the mean
        (loss_fn(model, mb).mean() / n).backward()


def ragged_weights(sizes):
    """Exercise 2: weight of each micro-batch's mean loss = its share of the window's samples."""
    total = sum(sizes)
    return [size / total for size in sizes]


def per_token_losses(token_losses, masks):
    """Exercise 3: one scalar per micro-batch whose sum is the window's per-token mean loss."""
    # Count the real tokens of the WHOLE window before any micro-batch is scaled.
    n_tokens = sum(mask.sum() for mask in masks)
    return [
        (losses * mask).sum() / n_tokens for losses, mask in zip(token_losses, masks, strict=True)
    ]


if __name__ == "__main__":
    from gas_lab.lessons.exercises.lesson01 import (
        check_accumulation_loop,
        check_per_token_losses,
        check_ragged_weights,
    )

    print(check_accumulation_loop(accumulation_loop))
    print(check_ragged_weights(ragged_weights))
    print(check_per_token_losses(per_token_losses))
