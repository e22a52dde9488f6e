"""Checkers for lesson 01 (accumulation on one device).

Each ``check_*`` runs the learner's function on small cases, compares with the library's
reference, and returns a :class:`Verdict`. Judges recognise the classic mistakes (forgotten
``/ N``, ``zero_grad()`` inside the loop, mean of means) and say so by name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gas_lab.accumulate import (
    Batch,
    Grads,
    accumulate_gradients,
    compare_grads,
    full_batch_gradient,
    grads_of,
    mse_loss,
    split_batch,
    token_loss,
)
from gas_lab.lessons.exercises.verdict import Verdict, check_cases
from gas_lab.lessons.toys import TinySeqModel, regression_batch, regression_mlp, sequence_batch

TOL = 1e-5  # max relative gradient error accepted: float32 noise is ~1e-7


def _close(got: Grads, ref: Grads) -> bool:
    return compare_grads(got, ref).max_rel < TOL


def _scaled(grads: Grads, factor: float) -> Grads:
    return {k: v * factor for k, v in grads.items()}


# ---------------------------------------------------------------- exercise 1: the loop
def _loop_case(fn: Callable, n_micro: int, stale: bool) -> Callable[[], dict]:
    def run() -> dict:
        batch = regression_batch(16, seed=n_micro)
        micro = split_batch(batch, n_micro)
        model = regression_mlp(seed=1)
        if stale:  # gradients left over from a "previous step"
            for p in model.parameters():
                p.grad = torch.ones_like(p)
        fn(model, micro, mse_loss)
        last = full_batch_gradient(regression_mlp(seed=1), micro[-1], mse_loss, "per_sample")
        return {
            "got": grads_of(model),
            "n": n_micro,
            "last": last,
            "ref": full_batch_gradient(regression_mlp(seed=1), batch, mse_loss, "per_sample"),
        }

    return run


def _judge_loop(r: dict) -> str | None:
    got, ref, n = r["got"], r["ref"], r["n"]
    if _close(got, ref):
        return None
    if n > 1 and _close(got, _scaled(ref, n)):
        return f"the gradient is {n}x the full-batch one: each micro-batch loss needs '/ N'."
    if n > 1 and (_close(got, _scaled(r["last"], 1 / n)) or _close(got, r["last"])):
        return (
            "the gradient equals the LAST micro-batch's alone: zero_grad() runs inside "
            "the loop and erases the earlier micro-batches."
        )
    if _close(got, {k: v + 1 for k, v in ref.items()}):
        return "the result still contains the stale gradient (all ones): zero it before the loop."
    return f"gradient differs from the full batch: {compare_grads(got, ref)}."


def check_accumulation_loop(fn: Callable) -> Verdict:
    """Exercise 1: ``fn(model, micro_batches, loss_fn)`` leaves the full-batch mean gradient."""
    cases = [
        ("one micro-batch", _loop_case(fn, 1, stale=False), _judge_loop),
        ("4 equal micro-batches", _loop_case(fn, 4, stale=False), _judge_loop),
        ("stale gradients from a previous step", _loop_case(fn, 4, stale=True), _judge_loop),
    ]
    return check_cases(
        "accumulation loop",
        cases,
        "zero the gradients once before the loop, then for each micro-batch "
        "call backward() on loss_fn(model, mb).mean() / N.",
    )


# ---------------------------------------------------------------- exercise 2: ragged weights
def _ragged_case(fn: Callable, sizes: list[int]) -> Callable[[], dict]:
    def run() -> dict:
        weights = [float(w) for w in fn(list(sizes))]
        return {"weights": weights, "sizes": sizes}

    return run


def _judge_ragged(r: dict) -> str | None:
    sizes, got = r["sizes"], r["weights"]
    want = [s / sum(sizes) for s in sizes]
    if len(got) == len(want) and max(abs(g - w) for g, w in zip(got, want, strict=True)) < 1e-6:
        return None
    shown = [round(w, 3) for w in got]
    if len(got) != len(sizes):
        return f"expected {len(sizes)} weights (one per micro-batch), got {len(got)}: {shown}."
    # measure what these weights would do to a real gradient
    batch = regression_batch(sum(sizes), seed=3)
    micro = split_batch(batch, sizes)
    model = regression_mlp(seed=1)
    model.zero_grad()
    for w, mb in zip(got, micro, strict=True):
        (w * mse_loss(model, mb).mean()).backward()
    err = compare_grads(grads_of(model), full_batch_gradient(regression_mlp(1), batch, mse_loss))
    name = (
        " (that is mean of means: 1/N each)"
        if all(abs(g - 1 / len(sizes)) < 1e-6 for g in got)
        else ""
    )
    return (
        f"expected weights {[round(w, 3) for w in want]}, got {shown}{name}; "
        f"the accumulated gradient is off by {err.max_rel:.1%} (max relative)."
    )


def check_ragged_weights(fn: Callable) -> Verdict:
    """Exercise 2: ``fn(sizes)`` gives each micro-batch's weight on its mean loss."""
    cases = [
        (f"sizes {s}", _ragged_case(fn, s), _judge_ragged)
        for s in ([4, 4, 4], [4, 4, 2], [1, 5, 2, 8])
    ]
    return check_cases(
        "weights for a ragged split",
        cases,
        "a micro-batch's mean loss stands for size_i samples out of sum(sizes); "
        "weigh it by its share of the window, not by 1/N.",
    )


# ---------------------------------------------------------------- exercise 3: per-token
def _token_case(fn: Callable, lengths: list[int], sizes: list[int]) -> Callable[[], dict]:
    def run() -> dict:
        batch = sequence_batch(lengths, seed=len(lengths))
        micro = split_batch(batch, sizes)
        model = TinySeqModel(seed=2)
        model.zero_grad()
        losses = fn([token_loss(model, mb) for mb in micro], [mb.mask for mb in micro])
        if len(losses) != len(micro):
            raise ValueError(
                f"expected {len(micro)} losses (one per micro-batch), got {len(losses)}"
            )
        detached = not all(torch.is_tensor(x) and x.requires_grad for x in losses)
        if not detached:
            torch.stack([x.reshape(()) for x in losses]).sum().backward()
        return {
            "got": grads_of(model),
            "detached": detached,
            "micro": micro,
            "ref": full_batch_gradient(TinySeqModel(seed=2), batch, token_loss, "per_token"),
        }

    return run


def _judge_tokens(r: dict) -> str | None:
    if r["detached"]:
        return "the returned losses carry no gradient: keep them tensors (no .item()/.detach())."
    if _close(r["got"], r["ref"]):
        return None
    for norm, what in [
        ("mean_of_means", "mean of means (each micro-batch divided by its own token count and N)"),
        ("per_sample", "per-sample normalization (each sequence averaged first)"),
    ]:
        if _close(
            r["got"], accumulate_gradients(TinySeqModel(seed=2), r["micro"], token_loss, norm)
        ):
            return (
                f"this is {what}, not per-token; gradient off by "
                f"{compare_grads(r['got'], r['ref']).max_rel:.1%} (max relative)."
            )
    unmasked = [
        Batch(mb.x, mb.y, None if mb.mask is None else torch.ones_like(mb.mask))
        for mb in r["micro"]
    ]
    if _close(
        r["got"], accumulate_gradients(TinySeqModel(seed=2), unmasked, token_loss, "per_token")
    ):
        return "padding positions are counted as tokens: multiply by the mask and count mask.sum()."
    return (
        f"gradient differs from the full-batch per-token one: {compare_grads(r['got'], r['ref'])}."
    )


def check_per_token_losses(fn: Callable) -> Verdict:
    """Exercise 3: ``fn(token_losses, masks)`` returns one scalar per micro-batch to backward."""
    cases = [
        ("no padding, equal micro-batches", _token_case(fn, [6] * 6, [3, 3]), _judge_tokens),
        (
            "padding: long then short sequences",
            _token_case(fn, [8, 8, 7, 3, 2, 1], [3, 3]),
            _judge_tokens,
        ),
        (
            "padding and a ragged last micro-batch",
            _token_case(fn, [5, 8, 2, 6, 3, 7, 1], [3, 3, 1]),
            _judge_tokens,
        ),
    ]
    return check_cases(
        "per-token normalization",
        cases,
        "count the real tokens of the WHOLE window first (sum of all masks), then "
        "give each micro-batch (losses * mask).sum() / that count.",
    )
