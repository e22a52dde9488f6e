"""Lesson 01 checkers: solutions pass, untouched stubs are 'todo', classic mistakes fail loudly."""

import importlib.util
from pathlib import Path

import pytest

from gas_lab.exercises.lesson01 import (
    check_accumulation_loop,
    check_per_token_losses,
    check_ragged_weights,
)
from gas_lab.exercises.verdict import ExerciseFailed

ROOT = Path(__file__).resolve().parents[1]


def _solutions():
    # solutions/ is not a package on purpose (handed out separately): load it by path
    spec = importlib.util.spec_from_file_location(
        "lesson01_solutions", ROOT / "solutions" / "lesson01.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SOL = _solutions()
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
    def stub(*args):
        raise NotImplementedError

    verdict = check(stub)
    assert verdict.status == "todo"
    assert "NotImplementedError" in verdict.message
    with pytest.raises(ExerciseFailed):
        verdict.raise_if_failed()


def _assert_failed(verdict, case, *words):
    assert verdict.status == "failed", str(verdict)
    assert f"case '{case}'" in verdict.message, verdict.message
    for word in words:
        assert word in verdict.message, verdict.message
    assert verdict.details and verdict.details[0].startswith("Hint:")
    with pytest.raises(ExerciseFailed):
        verdict.raise_if_failed()


# ---------------------------------------------------------------- exercise 1
def test_loop_forgetting_divide_is_named():
    def no_divide(model, micro_batches, loss_fn):
        model.zero_grad()
        for mb in micro_batches:
            loss_fn(model, mb).mean().backward()

    _assert_failed(check_accumulation_loop(no_divide), "4 equal micro-batches", "4x", "/ N")


def test_loop_zero_grad_inside_is_named():
    def zero_inside(model, micro_batches, loss_fn):
        for mb in micro_batches:
            model.zero_grad()
            (loss_fn(model, mb).mean() / len(micro_batches)).backward()

    _assert_failed(
        check_accumulation_loop(zero_inside), "4 equal micro-batches", "LAST", "zero_grad"
    )


def test_loop_never_zeroing_is_named():
    def never_zero(model, micro_batches, loss_fn):
        for mb in micro_batches:
            (loss_fn(model, mb).mean() / len(micro_batches)).backward()

    _assert_failed(
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
    _assert_failed(verdict, "sizes [4, 4, 2]", "mean of means", "[0.4, 0.4, 0.2]", "off by")
    # and the measured error is a real number, not zero
    off_by = float(verdict.message.split("off by ")[1].split("%")[0])
    assert off_by > 1.0
    assert verdict.cases_passed == 1  # the equal-size case was right


def test_ragged_weights_wrong_length_is_reported():
    _assert_failed(check_ragged_weights(lambda sizes: [1.0]), "sizes [4, 4, 4]", "3 weights")


# ---------------------------------------------------------------- exercise 3
def _mean_of_means(token_losses, masks):
    return [(t * m).sum() / m.sum() / len(masks) for t, m in zip(token_losses, masks, strict=True)]


def test_per_token_mean_of_means_fails_with_its_name():
    verdict = check_per_token_losses(_mean_of_means)
    _assert_failed(verdict, "padding: long then short sequences", "mean of means", "not per-token")
    assert verdict.cases_passed == 1  # no padding, equal micro-batches: mean of means is right


def test_per_token_counting_padding_is_named():
    def counts_padding(token_losses, masks):
        total = sum(t.numel() for t in token_losses)
        return [t.sum() / total for t in token_losses]

    _assert_failed(
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

    _assert_failed(
        check_per_token_losses(detached), "no padding, equal micro-batches", "no gradient"
    )
