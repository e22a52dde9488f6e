"""Appendix A6's loops in the checker's contract (:mod:`gas_lab.check`): the helpers every loop of
the appendix uses (a packed row's documents among them, :func:`documents`), :func:`token_step`,
the 'token' objective with the count of the whole step taken before the first ``backward()``,
and loops for trainers that learn the count only as they accumulate (a mask their loss
computes, say): :func:`scale_grads` and :func:`loss_scale_hack`.

A loop that counts as it goes backpropagates each micro-batch's summed loss, all-reduces the
count after the last ``backward()``, and must then multiply the accumulated gradients by
W / count before ``step()``. Where they are at that moment, in DeepSpeed 0.19.8 with
``"managed_gradient_accumulation": false`` (read in ``runtime/engine.py``, ``backward()`` and
``step()``, and ``runtime/zero/stage_1_and_2.py``):

* stage 0: each ``param.grad`` holds this rank's sum; ``step()`` all-reduces, then updates.
* stage 1: the same; ``step()`` reduces them (``reduce_gradients``), then updates.
* stage 2: every ``backward()`` has already reduced its buckets, added this rank's partition to
  the optimizer's own accumulators and set ``param.grad`` to None
  (``independent_gradient_partition_epilogue``); the partition the optimizer steps on is
  assembled only inside ``step()`` (``finalize_gradient_accumulation_boundary``).

DeepSpeed's public accessors, ``deepspeed.utils.safe_get_full_grad`` and ``safe_set_full_grad``,
read and write ``param.grad`` where it is set (stages 0 and 1: this rank's sum, not yet reduced,
which is right to scale since the reduction is linear), else that partition, which at stage 2
does not exist before ``step()``: they refuse, with a ValueError on each rank that holds a piece
of the parameter while the others wait in their all-reduce. So at stage 2 no public path scales
the gradients; what does is private (:func:`loss_scale_hack`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

FILLER = {  # one attended position, one document, weighed 0 wherever it is used
    "input_ids": torch.zeros(1, 1, dtype=torch.long),
    "labels": torch.zeros(1, 1, dtype=torch.long),
    "attention_mask": torch.ones(1, 1, dtype=torch.long),
    "position_ids": torch.zeros(1, 1, dtype=torch.long),
    "loss_mask": torch.ones(1, 1, dtype=torch.long),
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


def documents(mb):
    """[B, T, D]: 1 where position t of row b belongs to the row's document d. A document starts
    where ``position_ids`` is 0 on an attended position, so a packed row holds several."""
    attended = mb["attention_mask"] > 0
    starts = (mb["position_ids"] == 0) & attended
    index = starts.long().cumsum(1) - 1  # each position's document in its row (-1: before one)
    onehot = F.one_hot(index.clamp(min=0), int(starts.sum(1).max())).float()
    return onehot * (attended & (index >= 0)).unsqueeze(-1)


def document_tokens(mb):
    """Each document's labelled tokens, [B, D] (0 for a document with no label left)."""
    return (documents(mb) * (mb["labels"] != -100).unsqueeze(-1)).sum(1)


def document_means(engine, mb):
    """Each document's mean cross-entropy over its own labelled tokens (0 where it has none),
    [B, D]."""
    logits = engine(mb["input_ids"])
    ce = F.cross_entropy(logits.transpose(1, 2), mb["labels"], ignore_index=-100, reduction="none")
    return (documents(mb) * ce.unsqueeze(-1)).sum(1) / document_tokens(mb).clamp(min=1)


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


def _accumulate_then_count(engine, micro_batches) -> float:
    """Each micro-batch's summed loss backpropagated as it comes, its tokens counted as it goes;
    then every rank's count (one all-reduce, after the last backward())."""
    tokens = 0
    for mb, weight in padded(micro_batches):
        engine.backward(summed(engine, mb) * weight, scale_wrt_gas=False)
        tokens += labelled([mb]) if weight else 0
    return max(all_ranks(tokens), 1.0)


def scale_grads(engine, micro_batches):
    """Count as you go, then multiply every gradient by W / count with DeepSpeed's public
    accessors, then step()."""
    from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

    factor = dist.get_world_size() / _accumulate_then_count(engine, micro_batches)
    for p in engine.module.parameters():
        grad = safe_get_full_grad(p)
        if grad is not None:  # a parameter this step did not reach has none
            safe_set_full_grad(p, grad * factor)
    engine.step()


def loss_scale_hack(engine, micro_batches, reset: bool = True):
    """PRIVATE, ZeRO stages 1 and 2 only (at stage 0 the optimizer is torch's own): step() divides
    every gradient by the ZeRO optimizer's loss scale, an attribute DeepSpeed does not document,
    so setting it to count / W multiplies them by W / count. backward() multiplies every loss by
    the same scale, so it must be 1 again before the first backward() of each step (``reset``).
    DeepSpeed keeps it at 1 in fp32; under fp16 it is the dynamic loss scale itself, which
    backward() multiplied the loss by and step() checks for overflow and moves: overwriting it
    breaks both (read in runtime/zero/stage_1_and_2.py, ``step()`` and ``unscale_and_clip_grads``;
    DeepSpeed refuses fp16 on a CPU without fp16 support, appendix A1)."""
    scaler = engine.optimizer.loss_scaler
    if reset:
        scaler.cur_scale = 1.0
    scaler.cur_scale = _accumulate_then_count(engine, micro_batches) / dist.get_world_size()
    engine.step()


def loss_scale_hack_without_reset(engine, micro_batches):
    loss_scale_hack(engine, micro_batches, reset=False)
