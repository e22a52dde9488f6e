"""Lesson 01 checkers: solutions pass, untouched stubs are 'todo', classic mistakes fail loudly."""

import pytest
from exercise_support import assert_failed, assert_todo, load_solutions, todo

from gas_lab.lessons.exercises.lesson01 import (
    check_accumulation_loop,
    check_per_token_losses,
    check_ragged_weights,
)

SOL = load_solutions(1)
CHECKS = [
    (check_accumulation_loop, SOL.accumulation_loop),
    (check_ragged_weights, SOL.ragged_weights),
    (check_per_token_losses, SOL.per_token_losses),
]


@pytest.mark.parametrize(("check", "solution"), CHECKS)
def test_solution_passes(check, solution):
    verdict = check(solution).raise_if_failed()
    assert verdict.status == "passed" and verdict.cases_passed == verdict.cases_total == 3


@pytest.mark.parametrize(("check", "_solution"), CHECKS)
def test_untouched_stub_is_todo(check, _solution):
    assert_todo(check(todo))


# ---------------------------------------------------------------- exercise 1
def test_loop_forgetting_divide_is_named():
    def no_divide(model, micro_batches, loss_fn):
        model.zero_grad()
        for mb in micro_batches:
            loss_fn(model, mb).mean().backward()

    assert_failed(check_accumulation_loop(no_divide), "4 equal micro-batches", "4x", "/ N")


def test_loop_zero_grad_inside_is_named():
    def zero_inside(model, micro_batches, loss_fn):
        for mb in micro_batches:
            model.zero_grad()
            (loss_fn(model, mb).mean() / len(micro_batches)).backward()

    assert_failed(
        check_accumulation_loop(zero_inside), "4 equal micro-batches", "LAST", "zero_grad"
    )


def test_loop_never_zeroing_is_named():
    def never_zero(model, micro_batches, loss_fn):
        for mb in micro_batches:
            (loss_fn(model, mb).mean() / len(micro_batches)).backward()

    assert_failed(
        check_accumulation_loop(never_zero), "stale gradients from a previous step", "stale"
    )


def test_loop_that_crashes_is_reported():
    def crash(model, micro_batches, loss_fn):
        loss_fn(model, micro_batches).backward()  # passes the list, not a micro-batch

    verdict = check_accumulation_loop(crash)
    assert verdict.status == "failed" and "raised AttributeError" in verdict.message


# ---------------------------------------------------------------- exercise 2
def test_ragged_weights_mean_of_means_fails_on_the_ragged_case():
    verdict = check_ragged_weights(lambda sizes: [1 / len(sizes)] * len(sizes))
    assert_failed(verdict, "sizes [4, 4, 2]", "mean of means", "[0.4, 0.4, 0.2]", "off by")
    # and the measured error is a real number, not zero
    off_by = float(verdict.message.split("off by ")[1].split("%")[0])
    assert off_by > 1.0
    assert verdict.cases_passed == 1  # the equal-size case was right


def test_ragged_weights_wrong_length_is_reported():
    assert_failed(check_ragged_weights(lambda sizes: [1.0]), "sizes [4, 4, 4]", "3 weights")


# ---------------------------------------------------------------- exercise 3
def _mean_of_means(token_losses, masks):
    return [(t * m).sum() / m.sum() / len(masks) for t, m in zip(token_losses, masks, strict=True)]


def test_per_token_mean_of_means_fails_with_its_name():
    verdict = check_per_token_losses(_mean_of_means)
    assert_failed(verdict, "padding: long then short sequences", "mean of means", "not per-token")
    assert verdict.cases_passed == 1  # no padding, equal micro-batches: mean of means is right


def test_per_token_counting_padding_is_named():
    def counts_padding(token_losses, masks):
        total = sum(t.numel() for t in token_losses)
        return [t.sum() / total for t in token_losses]

    assert_failed(
        check_per_token_losses(counts_padding), "padding: long then short sequences", "padding"
    )


def test_per_token_per_micro_batch_count_is_caught():
    def local_count(token_losses, masks):  # per-token inside each micro-batch, no window count
        return [(t * m).sum() / m.sum() for t, m in zip(token_losses, masks, strict=True)]

    verdict = check_per_token_losses(local_count)
    assert verdict.status == "failed" and "no padding, equal micro-batches" in verdict.message


def test_per_token_detached_losses_are_named():
    def detached(token_losses, masks):
        return [x.detach() for x in SOL.per_token_losses(token_losses, masks)]

    assert_failed(
        check_per_token_losses(detached), "no padding, equal micro-batches", "no gradient"
    )
