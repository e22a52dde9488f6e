"""Checkers for lesson 01's exercises (accumulation on one device).

1. :func:`check_token_mean_stream`: the per-token mean (reduction ``"token"``) when the window's token count is
   known only *after* the last micro-batch (a loader that streams micro-batches and frees each
   one). The lesson counted the tokens first; here that is impossible.
2. :func:`check_clipped_step`: a bug hunt. :func:`buggy_clipped_step` has two bugs; the checker
   measures the parameters of the learner's fixed loop against one big clipped batch, and names
   the bug that is left by running each known mistake too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gas_lab.accumulate import (
    accumulate_gradients,
    compare_grads,
    full_batch_gradient,
    grads_of,
    mse_loss,
    split_batch,
    token_losses,
)
from gas_lab.lessons.exercises.verdict import Miss, Verdict, check_cases
from gas_lab.lessons.exercises.verdict import hint as hint  # lessonNN.hint()
from gas_lab.toys import (
    TinySeqModel,
    flat_params,
    regression_batch,
    regression_mlp,
    sequence_batch,
)

TOL = 1e-5  # max relative gradient error accepted: float32 noise is ~1e-7


class LookedAhead(RuntimeError):
    """Raised by the stream when micro-batch k+1 is asked for before micro-batch k's backward."""


# ---------------------------------------------------------------- exercise 1: a streamed window
def _stream(micro_batches, backwards: list[int]):
    """Hands out micro-batch k only after k backward passes reached the model (a loader that
    frees each micro-batch: no looking ahead at the window's token count)."""
    for k, mb in enumerate(micro_batches):
        if backwards[0] < k:
            raise LookedAhead(
                f"micro-batch {k + 1} was asked for before micro-batch {k}'s backward(): this "
                "stream frees a micro-batch once the next is handed out, so the window's token "
                "count cannot be known before the last backward()"
            )
        yield mb


def _stream_case(fn: Callable, lengths: list[int], sizes: list[int]) -> Callable[[], dict]:
    def run() -> dict:
        batch = sequence_batch(lengths, seed=len(lengths))
        micro = split_batch(batch, sizes)
        model, backwards = TinySeqModel(seed=2), [0]
        last = list(model.parameters())[-1]  # the output bias: every real token reaches it
        last.register_post_accumulate_grad_hook(
            lambda p: backwards.__setitem__(0, backwards[0] + 1)
        )
        fn(model, _stream(micro, backwards), token_losses)
        return {
            "got": grads_of(model),
            "micro": micro,
            "tokens": batch.n_tokens,
            "positions": batch.mask.numel(),
            "ref": full_batch_gradient(TinySeqModel(seed=2), batch, token_losses, "token"),
        }

    return run


def _running_count(micro) -> dict:
    """The mistake of dividing each micro-batch by the tokens seen *so far*."""
    model, seen = TinySeqModel(seed=2), 0
    for mb in micro:
        seen += mb.n_tokens
        ((token_losses(model, mb) * mb.mask).sum() / seen).backward()
    return grads_of(model)


def _judge_stream(r: dict) -> Miss | None:
    got, ref = r["got"], r["ref"]
    err = compare_grads(got, ref)
    if err.max_rel < TOL:
        return None
    off = f"off by {err.max_rel:.1%} (max relative)"
    # The right direction, a wrong size? Project the gradient on the reference's direction.
    dot = sum((got[k].double() * ref[k].double()).sum() for k in ref)
    factor = (dot / sum(ref[k].double().pow(2).sum() for k in ref)).item()
    if compare_grads(got, {k: v * factor for k, v in ref.items()}).max_rel < TOL:
        if abs(factor - r["tokens"]) < 1e-3 * r["tokens"]:
            return Miss(
                f"the gradient is {factor:.0f} x the per-token one: the SUM over the window's "
                f"{r['tokens']} real tokens.",
                "once the stream ends, divide every .grad by the count.",
            )
        if abs(factor * r["positions"] - r["tokens"]) < 1e-3 * r["tokens"]:
            return Miss(
                f"padding positions were counted: the gradient is divided by {r['positions']} "
                f"positions, the window has {r['tokens']} real tokens.",
                "count the real tokens only: sum the masks.",
            )
        return Miss(f"right direction, {factor:.3g} x the per-token gradient's size.")
    if compare_grads(got, _running_count(r["micro"])).max_rel < TOL:
        return Miss(
            f"each micro-batch was divided by the tokens seen SO FAR, so early ones weigh "
            f"more; {off}.",
            "backward() the SUMMED token loss, and divide once, by the final count, after the "
            "last backward().",
        )
    microbatch_mean = accumulate_gradients(TinySeqModel(seed=2), r["micro"], token_losses)
    if compare_grads(got, microbatch_mean).max_rel < TOL:
        return Miss(
            f"this is mean of means (each micro-batch divided by its own tokens and N); {off}."
        )
    return Miss(f"the gradient differs from the window's per-token gradient: {err}.")


def check_token_mean_stream(fn: Callable) -> Verdict:
    """Exercise 1: ``fn(model, stream, loss_fn)`` leaves the window's per-token gradient in
    ``.grad``; ``stream`` yields masked micro-batches one at a time, no looking ahead."""
    cases = [
        ("one micro-batch", _stream_case(fn, [5, 3, 4], [3]), _judge_stream),
        ("no padding, equal micro-batches", _stream_case(fn, [6] * 6, [2, 2, 2]), _judge_stream),
        (
            "padding: long then short sequences",
            _stream_case(fn, [8, 8, 7, 3, 2, 1], [3, 3]),
            _judge_stream,
        ),
        (
            "padding and a ragged last micro-batch",
            _stream_case(fn, [5, 8, 2, 6, 3, 7, 1], [3, 3, 1]),
            _judge_stream,
        ),
    ]
    return check_cases(
        "per-token normalization, counted after the fact",
        cases,
        "backward() each micro-batch's SUMMED token loss ((losses * mask).sum()), count its "
        "real tokens as you go, and when the stream ends divide every p.grad by the total: "
        "the gradient of a sum divided by T is the gradient of the per-token mean.",
        where="Pitfall 2's fix (one token count for the whole window) and *The idea* "
        "(what backward() does to .grad)",
    )


# ---------------------------------------------------------------- exercise 2: find the bugs
def buggy_clipped_step(model, optimizer, micro_batches, loss_fn, max_norm):
    """One SGD step over ``micro_batches`` (their sizes may differ), clipped at ``max_norm``."""
    optimizer.zero_grad()
    n = len(micro_batches)
    for mb in micro_batches:
        loss = loss_fn(model, mb).mean() / n
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()


def _variant(clip_inside: bool, reduction: str, clip: bool = True) -> Callable:
    """The given loop with each of its bugs kept or fixed (and clipping kept or dropped)."""

    def step(model, optimizer, micro_batches, loss_fn, max_norm):
        optimizer.zero_grad()
        total = sum(len(mb) for mb in micro_batches)
        for mb in micro_batches:
            weight = len(mb) / total if reduction == "sequence" else 1 / len(micro_batches)
            (loss_fn(model, mb).mean() * weight).backward()
            if clip and clip_inside:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if clip and not clip_inside:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()

    return step


_REFERENCE = _variant(clip_inside=False, reduction="sequence")
_MISTAKES = {  # the given loop keeps both; the first case that fails names the one left
    "clip inside": _variant(clip_inside=True, reduction="sequence"),
    "mean of means": _variant(clip_inside=False, reduction="microbatch-mean"),
    "no clipping": _variant(clip_inside=False, reduction="sequence", clip=False),
}
STEPS, LR = 3, 0.1


def _train(step_fn: Callable, sizes: list[int], max_norm: float) -> torch.Tensor:
    """``STEPS`` steps of SGD with ``step_fn``, each on a fresh batch split into ``sizes``."""
    model = regression_mlp(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        batch = regression_batch(sum(sizes), seed=10 + step)
        step_fn(model, optimizer, split_batch(batch, sizes), mse_loss, max_norm)
    return flat_params(model)


def _clip_case(fn: Callable, sizes: list[int], max_norm: float):
    def run():
        return sizes, max_norm, _train(fn, sizes, max_norm)

    def judge(result) -> Miss | None:
        sizes, max_norm, got = result
        ref = _train(_REFERENCE, sizes, max_norm)
        err = (got - ref).abs().max().item()
        if err <= 1e-6:
            return None
        for name, mistake in _MISTAKES.items():
            if (got - _train(mistake, sizes, max_norm)).abs().max().item() > 1e-6:
                continue
            what, fix = {
                "no clipping": (
                    "the parameters are those of a run WITHOUT clipping",
                    f"the step must still clip at max_norm = {max_norm:g}, once.",
                ),
                "clip inside": (
                    "clipping runs after every backward() and rescales the running sum each "
                    "time: the first micro-batches are shrunk once per later one, the last once",
                    "clip once, after the last backward(): clipping is about the gradient of "
                    "the whole batch.",
                ),
                "mean of means": (
                    f"micro-batches of sizes {sizes} all weigh 1/N, so a sample of the small "
                    "one weighs more than the others",
                    "weigh each micro-batch's mean by len(mb) / (samples in the window), not "
                    "by 1/N.",
                ),
            }[name]
            return Miss(
                f"{what}; the parameters are {err:.2g} from the reference after {STEPS} steps.",
                fix,
            )
        return Miss(f"the parameters are {err:.2g} from the reference after {STEPS} steps.")

    return run, judge


def check_clipped_step(fn: Callable) -> Verdict:
    """Exercise 2: ``fn(model, optimizer, micro_batches, loss_fn, max_norm)``, the fixed
    :func:`buggy_clipped_step`: the same parameters as one big batch, clipped at ``max_norm``."""
    big, small = 100.0, 0.05  # max_norm: never reached, or below every gradient norm here
    cases = {
        "equal micro-batches, no clipping needed": ([4, 4, 4, 4], big),
        "equal micro-batches, clipping active": ([4, 4, 4, 4], small),
        "ragged micro-batches, no clipping needed": ([4, 4, 2], big),
        "ragged micro-batches, clipping active": ([4, 4, 2], small),
    }
    return check_cases(
        "find the two bugs in the clipped step",
        [(name, *_clip_case(fn, *args)) for name, args in cases.items()],
        "clipping is about the gradient of the whole batch: clip once, after the last "
        "backward(); and with sizes that differ, weigh each micro-batch's mean by "
        "len(mb) / (samples in the window), not by 1/N.",
        where="*The idea* (what .grad holds after each backward()) and Pitfall 2 "
        "(micro-batches of different sizes)",
    )
