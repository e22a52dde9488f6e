"""Appendix A6's loops in the checker's contract (:mod:`gas_lab.check`): the helpers every loop of
the appendix uses, and :func:`token_step`, the 'token' objective with the count of the whole step
taken before the first ``backward()``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

FILLER = {
    "input_ids": torch.zeros(1, 1, dtype=torch.long),
    "labels": torch.zeros(1, 1, dtype=torch.long),
}


def summed(engine, mb):
    """The micro-batch's cross-entropy, summed over its labelled tokens (-100: none)."""
    logits = engine(mb["input_ids"])
    return F.cross_entropy(
        logits.flatten(0, 1), mb["labels"].flatten(), ignore_index=-100, reduction="sum"
    )


def all_ranks(x, op=dist.ReduceOp.SUM):
    t = torch.tensor([float(x)])
    dist.all_reduce(t, op=op)
    return t.item()


def labelled(micro_batches):
    return sum(int((mb["labels"] != -100).sum()) for mb in micro_batches)


def padded(micro_batches):
    """(micro-batch, weight): the real ones weigh 1, then fillers of weight 0 up to the busiest
    rank's count, so that every rank makes the same number of backward() calls."""
    busiest = int(all_ranks(len(micro_batches), dist.ReduceOp.MAX))
    return [(mb, 1.0) for mb in micro_batches] + [(FILLER, 0.0)] * (busiest - len(micro_batches))


def token_step(engine, micro_batches):
    world = dist.get_world_size()
    tokens = all_ranks(labelled(micro_batches))  # every rank's labelled tokens, this step
    for mb, weight in padded(micro_batches):
        engine.backward(summed(engine, mb) * world / tokens * weight, scale_wrt_gas=False)
    engine.step()
