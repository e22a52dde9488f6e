"""Checkers for lesson 08 (the edges of the loop), all on one process, a few seconds each.

1. :func:`check_sum_loss`: the micro-batch loss for ``"gradient_allreduce_op": "sum"`` handed
   to the *default* ``engine.backward(loss)`` (which divides by GAS): plays W ranks, sums their
   gradients as the sum all-reduce does, compares with the big batch's per-token gradient.
2. :func:`check_resume_position`: after loading a checkpoint saved mid-window in an unmanaged,
   ragged run, where to restart the data; trains a real gas_lab engine both ways.
3. :func:`check_token_count`: after ``load_checkpoint``, the token count that continues the
   lesson's token clock; steps real gas_lab engines with and without the save and compares
   their learning rates.

A first wrong try says what differs and where to look; the hint comes on a second try of the
same case or with ``lesson08.hint()`` (:mod:`gas_lab.lessons.exercises.verdict`).
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable

import torch

from gas_lab.accumulate import Batch, Window, compare_grads, full_batch_gradient, grads_of
from gas_lab.accumulate import token_losses as _token_losses
from gas_lab.lessons.exercises.verdict import Miss, Verdict, check_cases
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
            loss = loss_of(_token_losses(model, mb), mb.mask, mine, total, len(per_rank), gas)
            if not (torch.is_tensor(loss) and loss.requires_grad):
                raise TypeError("the loss carries no gradient: return a tensor, not .item()")
            (loss / gas).backward()
        grads.append(grads_of(model))
    return {k: sum(g[k] for g in grads) for k in grads[0]}


def _big_batch(per_rank: list[list[Batch]]) -> dict:
    every = [mb for mbs in per_rank for mb in mbs]
    big = Batch(*(torch.cat([getattr(m, k) for m in every]) for k in ("x", "y", "mask")))
    return full_batch_gradient(TinyTransformer(3), big, _token_losses, "token")


def _judge_sum(result) -> Miss | None:
    got, ref, w, gas = result
    err = compare_grads(got, ref)
    if err.max_rel < TOL:
        return None
    dot = sum((got[k].double() * ref[k].double()).sum() for k in ref)
    factor = (dot / sum(ref[k].double().pow(2).sum() for k in ref)).item()
    if compare_grads(got, {k: v * factor for k, v in ref.items()}).max_rel < TOL:
        differs = (
            f"the summed update points where the big batch's per-token gradient points, "
            f"but is {factor:.3g} x its size (expected 1 x)"
        )
        if abs(factor * gas - 1) < 1e-3:
            return Miss(
                differs,
                "engine.backward(loss) divides every loss by "
                "gradient_accumulation_steps; with gas micro-batches per rank, multiply "
                "by gas to undo it.",
            )
        if abs(factor - w) < 1e-3 or abs(factor - w / gas) < 1e-3:
            return Miss(
                differs,
                "with the sum all-reduce nothing divides by world_size, so "
                "there is nothing for x world_size to undo.",
            )
        return Miss(differs)
    return Miss(
        f"the summed update points elsewhere than the big batch's per-token gradient ({err})",
        "every real token of the step, on every rank, must weigh the same: "
        "divide by all_tokens, not by this rank's rank_tokens.",
    )


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
        ],
        "the sum all-reduce adds the ranks' gradients (no / world_size) and backward() still "
        "divides every loss by gradient_accumulation_steps.",
        where="section 5 (*Sum or mean*): lesson 07's loss and its sum variant",
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
        with tempfile.TemporaryDirectory(prefix="lesson08_") as folder:
            saver.save_checkpoint(folder)
            fresh, *_ = initialize(model=tiny_model(1), config=CONFIG)
            fresh.load_checkpoint(folder)
        steps = fresh.global_steps
        start = fn(steps, list(sizes))
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < len(stream):
            return start, None, sizes, steps
        _train(fresh, stream, sizes, start=start)
        diff = (flat_params(fresh.module) - flat_params(reference.module)).abs().max().item()
        return start, diff, sizes, steps

    return run


def _span(first: int, last: int, verb: str) -> str:
    """'micro-batch 3 runs twice' / 'micro-batches 4 to 7 run twice'."""
    if first == last:
        return f"micro-batch {first} {verb}s"
    return f"micro-batches {first} to {last} {verb}"


def _judge_resume(result) -> Miss | None:
    """What the restart index does to the run: which micro-batches run twice or never."""
    start, diff, sizes, steps = result
    right = sum(sizes[:steps])  # the first micro-batch of the window that was open
    n = sum(sizes)
    if diff is None:
        return Miss(
            f"returned {start!r}; expected an index into the stream of {n} micro-batches "
            f"(0 to {n - 1})"
        )
    if start == right and diff <= 1e-6:
        return None
    ends = f"the resumed run ends {diff:.1e} away from the uninterrupted one"
    if start < right:
        return Miss(
            f"restarting at micro-batch {start}: {_span(start, right - 1, 'run')} twice, "
            f"though the {steps} applied steps already hold them; {ends}",
            "global_steps counts the steps whose update happened: every micro-batch "
            "of those steps is in the loaded weights. Start after them.",
        )
    return Miss(
        f"restarting at micro-batch {start}: {_span(right, start - 1, 'never run')} "
        f"(step {steps} was open at the save); {ends}",
        "the open window's gradients were not saved: redo that window from its first micro-batch.",
    )


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
            ),
            (
                "steps of 2, 5, 1, saved at a boundary",
                _resume_case(fn, [2, 5, 1], 7),
                _judge_resume,
            ),
            ("steps of 1, 1, 6, saved mid step 2", _resume_case(fn, [1, 1, 6], 3), _judge_resume),
        ],
        "the checkpoint holds global_steps, the number of steps whose update happened; every "
        "micro-batch of those steps is in the weights, none of the open window's is.",
        where="section 4 (*Resume mid-window*): the three plans and the safe place to save",
    )


# ---------------------------------------------------------------- exercise 3: resume the clock
SCHEDULE = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
                                           "warmup_num_steps": 12, "warmup_type": "linear"}}  # fmt: skip


def token_clock(tokens_so_far: float, tokens_per_update: float) -> dict:
    """The lesson's clock: ``lr_kwargs`` after the update that brought the run to
    ``tokens_so_far`` tokens."""
    return {"last_batch_iteration": tokens_so_far / tokens_per_update - 1}


def _clocked(engine, tokens: list[int], per_update: float, seen: float = 0.0) -> list[float]:
    """Unmanaged updates on the token clock (no backward: an update of nothing moves the
    clock all the same); the lr after each."""
    lrs = []
    for t in tokens:
        seen += t
        engine.step(lr_kwargs=token_clock(seen, per_update))
        lrs.append(engine.get_lr()[0])
    return lrs


def _scenario(fn: Callable, tokens: list[int], per_update: float, save_after: int) -> dict:
    """One run saved after ``save_after`` updates and resumed with ``fn``'s count, and the
    uninterrupted run: their learning rates after the save, and the counts."""
    from gas_lab.deepspeed_compat.engine import initialize

    config = {**CONFIG, "scheduler": SCHEDULE}
    whole, *_ = initialize(model=tiny_model(0), config=config)
    want = _clocked(whole, tokens, per_update)[save_after:]
    saver, *_ = initialize(model=tiny_model(0), config=config)
    _clocked(saver, tokens[:save_after], per_update)
    with tempfile.TemporaryDirectory(prefix="lesson08_clock_") as folder:
        saver.save_checkpoint(folder)
        fresh, *_ = initialize(model=tiny_model(1), config=config)
        fresh.load_checkpoint(folder)
    lbi = fresh.lr_scheduler.last_batch_iteration
    candidates = {  # other numbers an engine holds after the load, scaled the clock's way
        "global_steps": fresh.global_steps * per_update,
        "last_batch_iteration": lbi * per_update,
        "zero": 0,
    }
    count = fn(fresh, per_update)
    if isinstance(count, bool) or not isinstance(count, (int, float)):
        return {"count": count, "got": None}
    got = _clocked(fresh, tokens[save_after:], per_update, seen=count)
    return {
        "count": count,
        "truth": sum(tokens[:save_after]),
        "got": got,
        "want": want,
        "matches": {k for k, v in candidates.items() if math.isclose(count, v)},
    }


# A second run (other tokens, another save point) each case also asks fn about: a mistake is
# named only when fn's count equals the same wrong quantity in both runs.
PROBE = ([40, 7, 300, 90, 15, 120], 64, 2)


def _count_case(fn: Callable, tokens: list[int], per_update: float, save_after: int):
    def run():
        return _scenario(fn, tokens, per_update, save_after), _scenario(fn, *PROBE)

    return run


FIXES = {
    "global_steps": "global_steps counts updates, and these updates held different numbers of "
    "tokens. The checkpoint restored the scheduler: its counter is the clock's last value.",
    "last_batch_iteration": "the counter after update k is k - 1 on DeepSpeed's clock; on the "
    "token clock it is tokens_so_far / tokens_per_update - 1: undo the - 1 too.",
    "zero": "a clock restarted at 0 runs the warm-up again. The checkpoint restored the "
    "scheduler: its counter is the clock's last value.",
}


def _judge_count(result) -> Miss | None:
    case, probe = result
    if case["got"] is None:
        return Miss(f"returned {case['count']!r}; expected a number of tokens")
    pairs = list(zip(case["got"], case["want"], strict=True))
    if all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) for a, b in pairs):
        return None
    k = next(i for i, (a, b) in enumerate(pairs) if not math.isclose(a, b, rel_tol=1e-9))
    differs = (
        f"resumed at {case['count']:g} tokens, where the run had seen {case['truth']}: "
        f"update {k + 1} after the load set the lr to {case['got'][k]:.6g}, the "
        f"uninterrupted run to {case['want'][k]:.6g}"
    )
    same = case["matches"] & probe.get("matches", set())
    return Miss(differs, FIXES[same.pop()] if len(same) == 1 else None)


def check_token_count(fn: Callable) -> Verdict:
    """Exercise 3: ``fn(engine, tokens_per_update)`` -> the token count to continue the
    token clock from after ``engine.load_checkpoint``."""
    return check_cases(
        "resume the token clock",
        [
            (
                "ragged updates, saved after 3",
                _count_case(fn, [30, 250, 60, 100, 10, 400], 100, 3),
                _judge_count,
            ),
            (
                "ragged updates, saved after 4",
                _count_case(fn, [7, 93, 41, 12, 150, 66], 50, 4),
                _judge_count,
            ),
        ],
        "the loaded engine's lr_scheduler came back from the checkpoint, and its "
        "last_batch_iteration is the last value the clock gave it: invert token_clock.",
        where="section 3 (*Schedules under a variable number of micro-batches*), token_clock; "
        "section 4 (*Resume mid-window*), what a checkpoint holds",
    )
