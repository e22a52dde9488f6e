"""Checkers for lesson 07 (the capstone): the micro-batch loss, and the step's global token count.

Exercise 1 runs on one process: it plays W ranks one after the other, averages their gradients
as DeepSpeed does at ``step()``, and compares with the gradient of every rank's rollouts as one
batch. Exercise 2 runs on the notebook's ranks (pass ``cluster``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gas_lab.accumulate import Batch, Window, compare_grads, full_batch_gradient, grads_of
from gas_lab.accumulate import token_loss as _token_loss
from gas_lab.lessons.exercises.on_ranks import run_on_ranks
from gas_lab.lessons.exercises.verdict import Verdict, check_cases
from gas_lab.lessons.rollouts import StepCounts, micro_batch_loss, rollouts
from gas_lab.lessons.toys import TinyTransformer

TOL = 1e-5  # max relative gradient error accepted (float32 noise is ~1e-7)

# (world size, step) with seed 7: step 3 gives 2 ranks 111 and 12 tokens; step 1 gives 3
# ranks 13, 67 and 41.
_TWO, _THREE = (2, 3), (3, 1)


def _per_rank(world_size: int, step: int) -> list[list[Batch]]:
    return [rollouts(step, r, seed=7) for r in range(world_size)]


def rank_averaged_gradient(per_rank: list[list[Batch]], loss_of: Callable) -> dict:
    """What DeepSpeed's ``step()`` applies, on one process: each rank's summed gradient of
    ``loss_of(token_losses, mask, counts)`` over its micro-batches, then the mean over ranks."""
    total = sum(Window.of(mbs).n_tokens for mbs in per_rank)
    grads = []
    for mbs in per_rank:
        counts, model = StepCounts(Window.of(mbs), total, len(per_rank)), TinyTransformer(3)
        for mb in mbs:
            loss = loss_of(_token_loss(model, mb), mb.mask, counts)
            if not (torch.is_tensor(loss) and loss.requires_grad):
                raise TypeError("the loss carries no gradient: return a tensor, not .item()")
            loss.backward()
        grads.append(grads_of(model))
    return {k: sum(g[k] for g in grads) / len(per_rank) for k in grads[0]}


def _big_batch_gradient(per_rank: list[list[Batch]]) -> dict:
    every = [mb for mbs in per_rank for mb in mbs]
    big = Batch(*(torch.cat([getattr(m, k) for m in every]) for k in ("x", "y", "mask")))
    return full_batch_gradient(TinyTransformer(3), big, _token_loss, "per_token")


# Wrong answers the judge recognises by their gradient, as (tl, mask, counts) -> loss.
_MISTAKES = {
    "local_tokens": lambda tl, m, c: micro_batch_loss(tl, m, "local_tokens", c),
    "mean_of_means": lambda tl, m, c: micro_batch_loss(tl, m, "mean_of_means", c),
    "own_mean": lambda tl, m, c: (tl * m).sum() / m.sum(),
    "padding": lambda tl, m, c: tl.sum() / c.global_tokens * c.world_size,
}


# ---------------------------------------------------------------- exercise 1
def _loss_case(fn: Callable, world_size: int, step: int) -> Callable[[], dict]:
    def learner(tl, mask, c: StepCounts):
        return fn(tl, mask, c.local.n_tokens, c.global_tokens, c.world_size)

    def run() -> dict:
        per_rank = _per_rank(world_size, step)
        return {
            "got": rank_averaged_gradient(per_rank, learner),
            "ref": _big_batch_gradient(per_rank),
            "per_rank": per_rank,
        }

    return run


def _judge_loss(r: dict) -> str | None:
    got, ref, per_rank = r["got"], r["ref"], r["per_rank"]
    err = compare_grads(got, ref)
    if err.max_rel < TOL:
        return None
    w = len(per_rank)

    def close(other: dict, factor: float = 1.0) -> bool:
        return compare_grads(got, {k: v * factor for k, v in other.items()}).max_rel < TOL

    def mistake(name: str) -> bool:
        return close(rank_averaged_gradient(per_rank, _MISTAKES[name]))

    off = f"off by {err.max_rel:.1%} (max relative)"
    # The right direction, a wrong size? Project the gradient on the reference's direction.
    dot = sum((got[k].double() * ref[k].double()).sum() for k in ref)
    factor = (dot / sum(ref[k].double().pow(2).sum() for k in ref)).item()
    if close(ref, factor):
        if abs(factor * w - 1) < 1e-3:
            return (
                f"the step's gradient is 1/{w} of the big batch's: DeepSpeed AVERAGES gradients "
                f"over the {w} ranks, so multiply each loss by world_size."
            )
        return (
            f"the step's gradient is {factor:.3g} x the big batch's: right direction, wrong "
            "size. The only factor the loss needs besides 1/all_tokens is x world_size, once."
        )
    if mistake("local_tokens"):
        return (
            "each rank divided by its OWN tokens (rank_tokens): after DeepSpeed's average, a "
            f"rank with few tokens weighs as much as one with many; {off}. Use all_tokens."
        )
    if mistake("mean_of_means") or mistake("own_mean"):
        return f"each micro-batch is divided by its own token count (mean of means); {off}."
    if mistake("padding"):
        return f"padding positions count as tokens: multiply the token losses by the mask; {off}."
    return f"the gradient differs from the big batch's: {err}."


def check_micro_batch_loss(fn: Callable) -> Verdict:
    """Exercise 1: ``fn(token_losses, mask, rank_tokens, all_tokens, world_size)`` -> scalar."""
    cases = [
        ("1 rank", _loss_case(fn, 1, 1), _judge_loss),
        ("2 ranks with very different token counts", _loss_case(fn, *_TWO), _judge_loss),
        ("3 ranks", _loss_case(fn, *_THREE), _judge_loss),
    ]
    return check_cases(
        "micro-batch loss for backward(scale_wrt_gas=False)",
        cases,
        "every real token of the step, on every rank, should weigh the same (padding: "
        "nothing); then remember that DeepSpeed divides the sum of the ranks' gradients by "
        "world_size at step().",
    )


# ---------------------------------------------------------------- exercise 2
def _count_on_rank(fn: Callable, step: int):
    """Runs on each rank: the learner's count for this rank's rollouts of ``step``."""
    import torch.distributed as dist

    # nccl reduces only GPU tensors: hand the masks over where this rank computes.
    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    masks = [mb.mask.to(device) for mb in rollouts(step, dist.get_rank(), seed=7)]
    out = fn(masks)
    return None if out is None else float(out)


def check_global_token_count(fn: Callable, cluster) -> Verdict:
    """Exercise 2: ``fn(masks)``, on every rank, returns the step's real tokens on ALL ranks."""
    w = cluster.world_size

    def run(step: int):
        return lambda: run_on_ranks(cluster, _count_on_rank, fn, step)

    def judge(step: int):
        per_rank = [rollouts(step, r, seed=7) for r in range(w)]
        mine = [float(Window.of(mbs).n_tokens) for mbs in per_rank]
        padded = [float(sum(mb.mask.numel() for mb in mbs)) for mbs in per_rank]

        def problem(got: list) -> str | None:
            want = sum(mine)
            for rank, value in enumerate(got):
                if value == want:
                    continue
                why = ""
                if value is None:
                    why = " (return the count)"
                elif value == mine[rank]:
                    why = " (this rank's own count: all_reduce it across ranks)"
                elif value == sum(padded) or value == padded[rank]:
                    why = " (padding counted: sum the masks, not their sizes)"
                elif value == want / w:
                    why = " (the mean over ranks: keep the SUM)"
                shown = "None" if value is None else f"{value:g}"
                return f"rank {rank} returned {shown}, expected {want:g} on every rank{why}."
            return None

        return problem

    return check_cases(
        "global token count",
        [(f"step {s}: tokens per rank {_tokens(s, w)}", run(s), judge(s)) for s in (3, 1)],
        "count this rank's real tokens (sum of the masks), put the number in a tensor, "
        "dist.all_reduce it (a sum), and return it; every rank must make the call.",
    )


def _tokens(step: int, world_size: int) -> list[int]:
    return [Window.of(rollouts(step, r, seed=7)).n_tokens for r in range(world_size)]
