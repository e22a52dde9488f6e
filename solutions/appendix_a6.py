"""Reference solution for appendix A6's exercise (tutorials/A6_your_own_loop.ipynb).

Kept apart from the notebook so an instructor can hand out one without the other. Checked by
the tool the appendix teaches: ``python -m gas_lab.check solutions/appendix_a6.py:sequence_step
--reduction sequence``.
"""

from __future__ import annotations

import torch.distributed as dist

from gas_lab.lessons.contract_loops import all_ranks, document_means, document_tokens, padded


def sequence_step(engine, micro_batches):
    """The 'sequence' objective: every rank's documents with a label are counted (one
    all-reduce, on every rank), a packed row's documents each on its own; each micro-batch's sum
    of document means times W over that count (step() averages the ranks); zero-weight fillers
    up to the busiest rank's count of micro-batches, so that every rank makes the same number of
    backward() calls (ZeRO-1, 2)."""
    world = dist.get_world_size()
    sequences = all_ranks(sum(int((document_tokens(mb) > 0).sum()) for mb in micro_batches))
    for mb, weight in padded(micro_batches):
        loss = document_means(engine, mb).sum() * world / sequences
        engine.backward(loss * weight, scale_wrt_gas=False)
    engine.step()


if __name__ == "__main__":
    from gas_lab.check import check_loop

    print(check_loop(sequence_step, reduction="sequence"))
