"""Loops in gas_lab.check's contract, right and wrong, for tests/test_check.py (the CLI test runs
this file as FILE.py:FUNCTION)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

# A practitioner's helper, as appendix A6 shows it: written on the loop's side, apart from the
# checker's own gas_lab.check.objectives.documents, so a mistake in one cannot hide in both.
from gas_lab.lessons.contract_loops import documents


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


# -- the batch as trainers carry it -------------------------------------------------------------
def right_token_kwargs(engine, micro_batches):
    """``engine(**micro_batch)`` on the toy: the logits tensor, every key passed."""
    world, tokens = dist.get_world_size(), total(labelled(micro_batches))
    for mb, real in padded(micro_batches):
        logits = engine(**mb)
        ce = F.cross_entropy(logits.transpose(1, 2), mb["labels"], reduction="none")
        engine.backward(ce.sum() * (world / tokens if real else 0.0), scale_wrt_gas=False)
    engine.step()


def right_token_loss_mask(engine, micro_batches):
    """verl's way: per-token losses weighed by the loss mask (no -100 needed)."""
    world = dist.get_world_size()
    tokens = total(sum(int(mb["loss_mask"].sum()) for mb in micro_batches))
    for mb, real in padded(micro_batches):
        logits = engine(mb["input_ids"])
        targets = mb["labels"].clamp(min=0)  # -100 -> any class: the mask weighs it 0
        ce = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        mask = mb.get("loss_mask", torch.zeros_like(targets))
        engine.backward((ce * mask).sum() * (world / tokens if real else 0.0))
    engine.step()


def right_sequence(engine, micro_batches):
    """The 'sequence' objective: every document (not row) with a target, on every rank."""
    world = dist.get_world_size()
    per_doc = [(documents(mb) * mb["loss_mask"].unsqueeze(-1)).sum(1) for mb in micro_batches]
    sequences = total(sum(int((n > 0).sum()) for n in per_doc))
    for i, (mb, real) in enumerate(padded(micro_batches)):
        if not real:
            engine.backward(engine(mb["input_ids"]).sum() * 0.0)
            continue
        ce = F.cross_entropy(engine(**mb).transpose(1, 2), mb["labels"], reduction="none")
        docs = documents(mb)
        means = (docs * ce.unsqueeze(-1)).sum(1) / per_doc[i].clamp(min=1)
        engine.backward(means.sum() * world / sequences, scale_wrt_gas=False)
    engine.step()


def right_microbatch_mean(engine, micro_batches):
    """Each micro-batch's own token mean, averaged over every non-empty micro-batch of every
    rank: what a per-micro-batch mean loss gives under managed accumulation."""
    world = dist.get_world_size()
    count = total(sum(1 for mb in micro_batches if labelled([mb])))
    for mb, real in padded(micro_batches):
        mean = summed(engine, mb) / max(labelled([mb]), 1)
        engine.backward(mean * (world / count if real else 0.0), scale_wrt_gas=False)
    engine.step()


# -- the Hugging Face way (model="hf": labels shifted by the model) ----------------------------
def hf_targets(mbs) -> int:
    """Targets after the model's shift: labels[:, 1:] that are not -100."""
    return sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in mbs)


def hf_padded(engine, micro_batches):
    """(output, weight): every real micro-batch, then zero-weight passes up to the busiest rank's
    count (a filler's mean loss over no target would be NaN, so a filler weighs its logits)."""
    most = int(total(len(micro_batches), dist.ReduceOp.MAX))
    for i in range(most):
        if i < len(micro_batches):
            yield micro_batches[i], 1.0
        else:
            yield None, 0.0


def hf_token_num_items(engine, micro_batches):
    """transformers' Trainer: out.loss with num_items_in_batch (every rank's targets), times W."""
    world, items = dist.get_world_size(), total(hf_targets(micro_batches))
    for mb, weight in hf_padded(engine, micro_batches):
        if mb is None:
            engine.backward(engine(input_ids=DUMMY["input_ids"]).logits.sum() * 0.0)
            continue
        out = engine(**mb, num_items_in_batch=items)
        engine.backward(out.loss * world * weight, scale_wrt_gas=False)
    engine.step()


def hf_token_logits(engine, micro_batches):
    """out.logits, shifted by hand, summed cross-entropy over every rank's targets, times W."""
    world, items = dist.get_world_size(), total(hf_targets(micro_batches))
    for mb, weight in hf_padded(engine, micro_batches):
        if mb is None:
            engine.backward(engine(input_ids=DUMMY["input_ids"]).logits.sum() * 0.0)
            continue
        logits = engine(**mb).logits[:, :-1]
        ce = F.cross_entropy(
            logits.transpose(1, 2), mb["labels"][:, 1:], ignore_index=-100, reduction="sum"
        )
        engine.backward(ce * world / items * weight, scale_wrt_gas=False)
    engine.step()


def hf_microbatch_mean(engine, micro_batches):
    """out.loss, transformers' mean over the micro-batch's targets, averaged over every
    non-empty micro-batch of every rank (an empty one's mean is NaN: it weighs 0 instead)."""
    world = dist.get_world_size()
    count = total(sum(1 for mb in micro_batches if hf_targets([mb])))
    for mb, weight in hf_padded(engine, micro_batches):
        if mb is None or not hf_targets([mb]):
            ids = DUMMY["input_ids"] if mb is None else mb["input_ids"]
            engine.backward(engine(input_ids=ids).logits.sum() * 0.0)
            continue
        engine.backward(engine(**mb).loss * world / count * weight, scale_wrt_gas=False)
    engine.step()


def hf_mean_loss_counts_empty(engine, micro_batches):
    """out.loss as it comes, averaged over every micro-batch: an all -100 micro-batch's mean is
    0/0 (NaN, with a gradient of 0), and it is counted."""
    world = dist.get_world_size()
    count = total(len(micro_batches))
    for mb, weight in hf_padded(engine, micro_batches):
        if mb is None:
            engine.backward(engine(input_ids=DUMMY["input_ids"]).logits.sum() * 0.0)
            continue
        engine.backward(engine(**mb).loss * world / count * weight, scale_wrt_gas=False)
    engine.step()


# -- mistakes only the newer cases show ---------------------------------------------------------
def completion_length(engine, micro_batches):
    """Counts each completion's length (its first target to its last) where it meant its
    targets: the same count until unlabelled positions sit inside a completion."""

    def length(mb):
        docs = documents(mb) * mb["loss_mask"].unsqueeze(-1)  # [B, T, D]
        t = torch.arange(docs.shape[1]).view(1, -1, 1)
        first = torch.where(docs > 0, t, 10**6).amin(1)
        last = torch.where(docs > 0, t, -1).amax(1)
        return int((last - first + 1).clamp(min=0).sum())

    world, tokens = dist.get_world_size(), total(sum(length(mb) for mb in micro_batches))
    for mb, real in padded(micro_batches):
        engine.backward(summed(engine, mb) * (world / tokens if real else 0.0))
    engine.step()


def empty_micro_batch_as_one(engine, micro_batches):
    """Each micro-batch's count clamped to 1 before the sum: an empty one counts a token."""
    world = dist.get_world_size()
    tokens = total(sum(max(labelled([mb]), 1) for mb in micro_batches))
    for mb, real in padded(micro_batches):
        engine.backward(summed(engine, mb) * (world / tokens if real else 0.0))
    engine.step()


def dr_grpo_width(engine, micro_batches, max_length=10):
    """Dr. GRPO dividing by the tensor's width where it meant the maximum length."""
    world = dist.get_world_size()
    sequences = total(sum(int(documents(mb).amax(1).sum()) for mb in micro_batches))
    for mb, real in padded(micro_batches):
        width = mb["labels"].shape[1]
        engine.backward(summed(engine, mb) * (world / (sequences * width) if real else 0.0))
    engine.step()


def world_of_two(engine, micro_batches):
    """The right token loop with the world size written in: right on 2 ranks only."""
    tokens = total(labelled(micro_batches))
    for mb, real in padded(micro_batches):
        engine.backward(summed(engine, mb) * (2 / tokens if real else 0.0))
    engine.step()


def fixed_denominator(engine, micro_batches):
    """Divides by a fixed 8 (a batch size from a config) where it meant a count of sequences."""
    for mb, real in padded(micro_batches):
        engine.backward(summed(engine, mb) * (1 / 8 if real else 0.0))
    engine.step()


def gas_divided(engine, micro_batches):
    """OpenRLHF before #1249: each micro-batch's own mean, and backward() divides by GAS."""
    for mb, real in padded(micro_batches):
        engine.backward(summed(engine, mb) / max(labelled([mb]), 1) * (1.0 if real else 0.0))
    engine.step()


# -- a user's own objective (--objective check_loops.py:sequence_sums_over_8) -------------------
def sequence_sums_over_8(ranks):
    """Each sequence's token mean, summed over every rank's sequences, divided by a fixed 8."""
    out = []
    for mbs in ranks:
        row = []
        for mb in mbs:
            docs = documents(mb) * mb["loss_mask"].unsqueeze(-1)
            per_doc = docs.sum(1, keepdim=True).clamp(min=1)
            row.append((docs / per_doc).sum(-1) / 8)
        out.append(row)
    return out


def sequence_sums_over_8_loop(engine, micro_batches):
    world = dist.get_world_size()
    for mb, real in padded(micro_batches):
        if not real:
            engine.backward(engine(mb["input_ids"]).sum() * 0.0)
            continue
        ce = F.cross_entropy(engine(**mb).transpose(1, 2), mb["labels"], reduction="none")
        docs = documents(mb) * mb["loss_mask"].unsqueeze(-1)
        means = (docs * ce.unsqueeze(-1)).sum(1) / docs.sum(1).clamp(min=1)
        engine.backward(means.sum() * world / 8, scale_wrt_gas=False)
    engine.step()


def objective_wrong_shape(ranks):
    return [[mb["labels"][:, 0].float() for mb in mbs] for mbs in ranks]
