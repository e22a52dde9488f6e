"""Loops in gas_lab.check's contract, right and wrong, for tests/test_check.py (the CLI test runs
this file as FILE.py:FUNCTION)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F


def summed(engine, mb) -> torch.Tensor:
    """The micro-batch's cross-entropies, summed over its labelled tokens."""
    logits = engine(mb["input_ids"])
    return F.cross_entropy(
        logits.flatten(0, 1), mb["labels"].flatten(), ignore_index=-100, reduction="sum"
    )


def total(x: float, op=dist.ReduceOp.SUM) -> float:
    t = torch.tensor([float(x)])
    dist.all_reduce(t, op=op)
    return t.item()


def labelled(mbs) -> int:
    return sum(int((mb["labels"] != -100).sum()) for mb in mbs)


DUMMY = {
    "input_ids": torch.zeros(1, 1, dtype=torch.long),
    "labels": torch.zeros(1, 1, dtype=torch.long),
}


def padded(micro_batches):
    """(micro-batch, is it real) up to the busiest rank's count: every rank makes the same number
    of backward() calls, which ZeRO-1 (a rank with none) and ZeRO-2 (any difference) need."""
    most = int(total(len(micro_batches), dist.ReduceOp.MAX))
    return [
        (micro_batches[i], True) if i < len(micro_batches) else (DUMMY, False) for i in range(most)
    ]


def right_token(engine, micro_batches):
    world, tokens = dist.get_world_size(), total(labelled(micro_batches))
    for mb, real in padded(micro_batches):
        engine.backward(summed(engine, mb) * (world / tokens if real else 0.0))
    engine.step()


def unpadded_token(engine, micro_batches):
    """Right weights, but no zero-weight micro-batches: right only when counts are equal."""
    world, tokens = dist.get_world_size(), total(labelled(micro_batches))
    for mb in micro_batches:
        engine.backward(summed(engine, mb) * world / tokens)
    engine.step()


def mean_of_means(engine, micro_batches):
    """Each micro-batch's own token mean, averaged over the rank's micro-batches."""
    for mb, real in padded(micro_batches):
        mean = summed(engine, mb) / max(labelled([mb]), 1)
        engine.backward(mean / max(len(micro_batches), 1) * (1.0 if real else 0.0))
    engine.step()


def own_tokens(engine, micro_batches):
    """Each rank divides by its own labelled tokens."""
    mine = max(labelled(micro_batches), 1)
    for mb, real in padded(micro_batches):
        engine.backward(summed(engine, mb) / mine * (1.0 if real else 0.0))
    engine.step()


def no_world_factor(engine, micro_batches):
    """Every rank's token count, but not multiplied by the world size."""
    tokens = total(labelled(micro_batches))
    for mb, real in padded(micro_batches):
        engine.backward(summed(engine, mb) / tokens * (1.0 if real else 0.0))
    engine.step()


def raises(engine, micro_batches):
    raise ValueError("the loop's own mistake")


def hangs_when_idle(engine, micro_batches):
    """A rank without micro-batches returns before the count's all-reduce: the other waits."""
    if not micro_batches:
        return
    right_token(engine, micro_batches)


def two_steps(engine, micro_batches):
    right_token(engine, micro_batches)
    right_token(engine, micro_batches)


def wrong_signature(engine):
    pass
