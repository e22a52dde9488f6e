"""Lesson 01 checkers: solutions pass, untouched stubs are 'todo', typical mistakes are named."""

import pytest
import torch
from exercise_support import (
    assert_failed,
    assert_hint_on_second_try,
    assert_todo,
    load_solutions,
    reset_tries,
    todo,
)

from gas_lab.lessons.exercises.lesson01 import (
    buggy_clipped_step,
    check_clipped_step,
    check_token_mean_stream,
)

SOL = load_solutions(1)
CHECKS = [
    (check_token_mean_stream, SOL.token_mean_stream),
    (check_clipped_step, SOL.clipped_step),
]


@pytest.mark.parametrize(("check", "solution"), CHECKS)
def test_solution_passes(check, solution):
    verdict = check(solution).raise_if_failed()
    assert verdict.status == "passed" and verdict.cases_passed == verdict.cases_total == 4


@pytest.mark.parametrize(("check", "_solution"), CHECKS)
def test_untouched_stub_is_todo(check, _solution):
    assert_todo(check(todo))


# ---------------------------------------------------------------- exercise 1
def _summed_only(model, stream, loss_fn):
    for mb in stream:
        (loss_fn(model, mb) * mb.mask).sum().backward()


def _running_count(model, stream, loss_fn):
    seen = 0
    for mb in stream:
        seen += int(mb.mask.sum())
        ((loss_fn(model, mb) * mb.mask).sum() / seen).backward()


def _own_mean(model, stream, loss_fn):  # each micro-batch's own per-token mean: mean of means
    micro = []
    for mb in stream:
        micro.append(mb)
        ((loss_fn(model, mb) * mb.mask).sum() / mb.mask.sum()).backward()
    for p in model.parameters():
        p.grad /= len(micro)


def _counts_padding(model, stream, loss_fn):
    positions = 0
    for mb in stream:
        (loss_fn(model, mb) * mb.mask).sum().backward()
        positions += mb.mask.numel()
    for p in model.parameters():
        p.grad /= positions


def _looks_ahead(model, stream, loss_fn):
    micro = list(stream)  # the lesson's way: count first. This stream does not allow it.
    n_tokens = sum(int(mb.mask.sum()) for mb in micro)
    for mb in micro:
        ((loss_fn(model, mb) * mb.mask).sum() / n_tokens).backward()


@pytest.mark.parametrize(
    ("wrong", "case", "words", "hint"),
    [
        (_summed_only, "one micro-batch", ["SUM over the window's"], "divide every .grad"),
        (_running_count, "no padding, equal micro-batches", ["SO FAR", "off by"], "once"),
        (_own_mean, "padding: long then short sequences", ["mean of means", "off by"], "SUMMED"),
        (_counts_padding, "one micro-batch", ["padding positions were counted"], "sum the masks"),
    ],
)
def test_stream_mistakes_are_named_then_hinted(wrong, case, words, hint):
    verdict = check_token_mean_stream(wrong)
    assert_failed(verdict, case, *words)
    assert hint not in str(verdict)
    assert "Look again at: Pitfall 2's fix" in str(verdict)
    reset_tries()
    assert_hint_on_second_try(lambda: check_token_mean_stream(wrong), hint)


def test_looking_ahead_is_refused_by_the_stream():
    verdict = check_token_mean_stream(_looks_ahead)
    assert_failed(verdict, "no padding, equal micro-batches", "raised LookedAhead", "before")
    assert verdict.cases_passed == 1  # a single micro-batch leaves nothing to look ahead at


# ---------------------------------------------------------------- exercise 2
def _clip_fixed_only(model, optimizer, micro_batches, loss_fn, max_norm):
    optimizer.zero_grad()
    for mb in micro_batches:
        (loss_fn(model, mb).mean() / len(micro_batches)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()


def _clipping_removed(model, optimizer, micro_batches, loss_fn, max_norm):
    optimizer.zero_grad()
    total = sum(len(mb) for mb in micro_batches)
    for mb in micro_batches:
        (loss_fn(model, mb).mean() * len(mb) / total).backward()
    optimizer.step()


def test_the_given_loop_fails_on_its_clipping_bug_first():
    verdict = check_clipped_step(buggy_clipped_step)
    assert_failed(verdict, "equal micro-batches, clipping active", "after every backward()")
    assert verdict.cases_passed == 1  # equal sizes and no clipping: the bugs are invisible
    assert "clip once" not in str(verdict)
    reset_tries()
    assert_hint_on_second_try(lambda: check_clipped_step(buggy_clipped_step), "clip once")


def test_the_bug_left_over_is_named():
    verdict = check_clipped_step(_clip_fixed_only)
    assert_failed(verdict, "ragged micro-batches, no clipping needed", "[4, 4, 2]", "1/N")
    verdict = check_clipped_step(_clipping_removed)
    assert_failed(verdict, "equal micro-batches, clipping active", "WITHOUT clipping")
