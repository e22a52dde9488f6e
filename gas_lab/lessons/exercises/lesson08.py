"""Checkers for lesson 08 (the edges of the loop), all on one process, a few seconds each.

1. :func:`check_sum_loss`: the micro-batch loss for ``"gradient_allreduce_op": "sum"`` handed
   to the *default* ``engine.backward(loss)`` (which divides by GAS): plays W ranks, sums their
   gradients as the sum all-reduce does, compares with the big batch's per-token gradient.
2. :func:`check_resume_position`: after loading a checkpoint saved mid-window in an unmanaged,
   ragged run, where to restart the data; trains a real gas_lab engine both ways.
3. :func:`check_token_clock`: ``lr_kwargs`` that make ``WarmupLR`` count tokens, not updates;
   steps a real gas_lab engine and compares its learning rates with the token clock's.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable

import torch

from gas_lab.accumulate import Batch, Window, compare_grads, full_batch_gradient, grads_of
from gas_lab.accumulate import token_loss as _token_loss
from gas_lab.lessons.exercises.verdict import Verdict, check_cases
from gas_lab.lessons.exercises.verdict import hint as hint  # lessonNN.hint()
from gas_lab.lessons.rollouts import rollouts
from gas_lab.toys import TinyTransformer, flat_params, micro_batch, tiny_model

TOL = 1e-5


# ---------------------------------------------------------------- exercise 1: sum, /T, x GAS
def summed_gradient(per_rank: list[list[Batch]], loss_of: Callable, gas: int) -> dict:
    """What ``step()`` applies with the sum all-reduce: each rank's gradients of
    ``loss_of(...) / gas`` (``engine.backward`` divides by GAS), summed over ranks."""
    total = sum(Window.of(mbs).n_tokens for mbs in per_rank)
    grads = []
    for mbs in per_rank:
        model, mine = TinyTransformer(3), Window.of(mbs).n_tokens
        for mb in mbs:
            loss = loss_of(_token_loss(model, mb), mb.mask, mine, total, len(per_rank), gas)
            if not (torch.is_tensor(loss) and loss.requires_grad):
                raise TypeError("the loss carries no gradient: return a tensor, not .item()")
            (loss / gas).backward()
        grads.append(grads_of(model))
    return {k: sum(g[k] for g in grads) for k in grads[0]}


def _big_batch(per_rank: list[list[Batch]]) -> dict:
    every = [mb for mbs in per_rank for mb in mbs]
    big = Batch(*(torch.cat([getattr(m, k) for m in every]) for k in ("x", "y", "mask")))
    return full_batch_gradient(TinyTransformer(3), big, _token_loss, "per_token")


def _judge_sum(result) -> str | None:
    got, ref, w, gas = result
    err = compare_grads(got, ref)
    if err.max_rel < TOL:
        return None
    dot = sum((got[k].double() * ref[k].double()).sum() for k in ref)
    factor = (dot / sum(ref[k].double().pow(2).sum() for k in ref)).item()
    if compare_grads(got, {k: v * factor for k, v in ref.items()}).max_rel < TOL:
        if abs(factor * gas - 1) < 1e-3:
            return (f"the update is 1/{gas} of the big batch's: engine.backward(loss) divides by "
                    f"gradient_accumulation_steps = {gas}; multiply by gas to undo it.")  # fmt: skip
        if abs(factor - w) < 1e-3 or abs(factor - w / gas) < 1e-3:
            return (f"the update is {factor:.3g} x the big batch's: with the sum all-reduce "
                    "nothing divides by world_size, so there is nothing for x world_size to undo.")  # fmt: skip
        return f"the update is {factor:.3g} x the big batch's: right direction, wrong size."
    return (f"the gradient differs from the big batch's ({err}): divide by all_tokens, the "
            "step's real tokens on every rank, not by this rank's.")  # fmt: skip


def check_sum_loss(fn: Callable) -> Verdict:
    """Exercise 1: ``fn(token_losses, mask, rank_tokens, all_tokens, world_size, gas)``."""

    def case(world_size, step, gas):
        def run():
            per_rank = [rollouts(step, r, seed=7) for r in range(world_size)]
            return summed_gradient(per_rank, fn, gas), _big_batch(per_rank), world_size, gas

        return run

    return check_cases(
        "micro-batch loss for the sum all-reduce and the default backward()",
        [
            ("1 rank, GAS 4", case(1, 1, 4), _judge_sum),
            ("2 ranks, GAS 4", case(2, 3, 4), _judge_sum),
            ("3 ranks, GAS 2", case(3, 1, 2), _judge_sum),
        ],  # fmt: skip
        "the sum all-reduce adds the ranks' gradients (no / world_size) and backward() still "
        "divides every loss by gradient_accumulation_steps.",
    )


# ---------------------------------------------------------------- exercise 2: where to restart
CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
          "managed_gradient_accumulation": False, "gradient_clipping": 0.0,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}}  # fmt: skip


def _train(engine, stream, sizes, start=0, stop=None):
    """Unmanaged: run micro-batches ``stream[start:stop]``; step() after each step's last."""
    ends = {sum(sizes[: s + 1]) for s in range(len(sizes))}
    for i in range(start, len(stream) if stop is None else stop):
        x, y = stream[i]
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        if i + 1 in ends:
            engine.step()


def _resume_case(fn: Callable, sizes: list[int], save_after: int) -> Callable[[], tuple]:
    def run():
        from gas_lab.deepspeed_compat.engine import initialize

        stream = [micro_batch(0, 0, i, 0, 2) for i in range(sum(sizes))]
        reference, *_ = initialize(model=tiny_model(0), config=CONFIG)
        _train(reference, stream, sizes)
        saver, *_ = initialize(model=tiny_model(0), config=CONFIG)
        _train(saver, stream, sizes, stop=save_after)
        folder = tempfile.mkdtemp(prefix="lesson08_")
        saver.save_checkpoint(folder)
        fresh, *_ = initialize(model=tiny_model(1), config=CONFIG)
        fresh.load_checkpoint(folder)
        start = fn(fresh.global_steps, list(sizes))
        if not isinstance(start, int) or not 0 <= start <= save_after:
            return start, None, sizes, save_after, fresh.global_steps
        _train(fresh, stream, sizes, start=start)
        diff = (flat_params(fresh.module) - flat_params(reference.module)).abs().max().item()
        return start, diff, sizes, save_after, fresh.global_steps

    return run


def _judge_resume(result) -> str | None:
    start, diff, sizes, save_after, steps = result
    right = sum(sizes[:steps])
    if diff is not None and diff <= 1e-6:
        return None
    if start == save_after:
        return (f"restarting at micro-batch {start}, where the save happened, loses the "
                f"{save_after - right} micro-batches of the open window: their gradients were "
                "not saved. Redo the window from its first micro-batch.")  # fmt: skip
    if start == steps * CONFIG["gradient_accumulation_steps"]:
        return (f"{steps} x gradient_accumulation_steps = {start} assumes every step had GAS "
                f"micro-batches; this run's steps had {sizes[:steps]}.")  # fmt: skip
    return f"restarting at micro-batch {start!r} ends {diff} away from the uninterrupted run."


def check_resume_position(fn: Callable) -> Verdict:
    """Exercise 2: ``fn(global_steps, micro_batches_per_step)`` -> index of the first
    micro-batch to run after ``load_checkpoint`` (a save may have happened mid-window)."""
    return check_cases(
        "where to restart after a mid-window checkpoint",
        [
            (
                "steps of 3, 1, 4, 2 micro-batches, saved mid step 2",
                _resume_case(fn, [3, 1, 4, 2], 6),
                _judge_resume,
            ),  # noqa: E501
            (
                "steps of 2, 5, 1, saved at a boundary",
                _resume_case(fn, [2, 5, 1], 7),
                _judge_resume,
            ),
            ("steps of 1, 1, 6, saved mid step 2", _resume_case(fn, [1, 1, 6], 3), _judge_resume),
        ],  # fmt: skip
        "the checkpoint holds global_steps, the number of steps whose update happened; every "
        "micro-batch of those steps is in the weights, none of the open window's is.",
    )


# ---------------------------------------------------------------- exercise 3: a token clock
SCHEDULE = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
                                           "warmup_num_steps": 4, "warmup_type": "linear"}}  # fmt: skip


def token_clock_lr(tokens_so_far: float, nominal: float) -> float:
    """WarmupLR's lr after an update that brought the run to ``tokens_so_far`` tokens, when
    ``nominal`` tokens count as one update (the lr the *next* update uses)."""
    p = SCHEDULE["params"]
    i = tokens_so_far / nominal - 1
    frac = 0.0 if i < 0 else min(1.0, i / p["warmup_num_steps"])  # before "the start": min
    return p["warmup_min_lr"] + (p["warmup_max_lr"] - p["warmup_min_lr"]) * frac


def _clock_case(fn: Callable, tokens: list[int], nominal: int) -> Callable[[], tuple]:
    def run():
        from gas_lab.deepspeed_compat.engine import initialize

        engine, *_ = initialize(model=tiny_model(0), config={**CONFIG, "scheduler": SCHEDULE})
        got, seen = [], 0
        for t in tokens:
            seen += t
            engine.step(lr_kwargs=fn(seen, nominal))  # no backward needed to move the clock
            got.append(engine.get_lr()[0])
        return got, [token_clock_lr(s, nominal) for s in _cumsum(tokens)], tokens, nominal

    return run


def _cumsum(xs):
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out


def _judge_clock(result) -> str | None:
    got, want, tokens, nominal = result
    if all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) for a, b in zip(got, want, strict=True)):
        return None
    ahead = [token_clock_lr(s + nominal, nominal) for s in _cumsum(tokens)]
    if all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(got, ahead, strict=True)):
        return ("one update ahead: after its k-th update DeepSpeed's counter is k - 1 (it "
                "starts at -1), so subtract 1.")  # fmt: skip
    k = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if not math.isclose(a, b))
    return (f"after update {k + 1} ({_cumsum(tokens)[k]} tokens, {nominal} per nominal update) "
            f"the lr is {got[k]:.6g}, the token clock says {want[k]:.6g}.")  # fmt: skip


def check_token_clock(fn: Callable) -> Verdict:
    """Exercise 3: ``fn(tokens_so_far, tokens_per_update)`` -> the ``lr_kwargs`` dict."""
    return check_cases(
        "WarmupLR on a token clock",
        [
            ("every update has the nominal tokens", _clock_case(fn, [100] * 6, 100), _judge_clock),
            ("ragged updates", _clock_case(fn, [30, 250, 60, 100, 10, 400], 100), _judge_clock),
        ],  # fmt: skip
        "engine.step(lr_kwargs=...) calls scheduler.step(**lr_kwargs) after the update; "
        "WarmupLR.step takes last_batch_iteration, and any number (not only an int) works.",
    )
