"""Reference solution for appendix A6's exercise (tutorials/A6_your_own_loop.ipynb).

Kept apart from the notebook so an instructor can hand out one without the other. Checked by
the tool the appendix teaches: ``python -m gas_lab.check solutions/appendix_a6.py:sequence_step
--reduction sequence``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

FILLER = {
    "input_ids": torch.zeros(1, 1, dtype=torch.long),
    "labels": torch.zeros(1, 1, dtype=torch.long),
}


def all_ranks(x, op=dist.ReduceOp.SUM):
    t = torch.tensor([float(x)])
    dist.all_reduce(t, op=op)
    return t.item()


def sequence_means(engine, mb):
    """Each sequence's mean over its own labelled tokens (0 for a sequence with none), [B]."""
    logits = engine(mb["input_ids"])
    ce = F.cross_entropy(logits.transpose(1, 2), mb["labels"], ignore_index=-100, reduction="none")
    return ce.sum(1) / (mb["labels"] != -100).sum(1).clamp(min=1)


def sequence_step(engine, micro_batches):
    """The 'sequence' objective: every rank's sequences with a label are counted (one
    all-reduce, on every rank); each micro-batch's sum of sequence means times W over that count
    (step() averages the ranks); zero-weight fillers up to the busiest rank's count of
    micro-batches, so that every rank makes the same number of backward() calls (ZeRO-1, 2)."""
    world = dist.get_world_size()
    sequences = all_ranks(
        sum(int(((mb["labels"] != -100).sum(1) > 0).sum()) for mb in micro_batches)
    )
    busiest = int(all_ranks(len(micro_batches), dist.ReduceOp.MAX))
    padded = [(mb, 1.0) for mb in micro_batches] + [(FILLER, 0.0)] * (busiest - len(micro_batches))
    for mb, weight in padded:
        loss = sequence_means(engine, mb).sum() * world / sequences
        engine.backward(loss * weight, scale_wrt_gas=False)
    engine.step()


if __name__ == "__main__":
    from gas_lab.check import check_loop

    print(check_loop(sequence_step, reduction="sequence"))
