"""Lesson 03 checkers: solutions pass, untouched stubs are 'todo', classic mistakes fail loudly."""

import pytest
from exercise_support import assert_failed, assert_todo, load_solutions, todo, without_launcher_env

from gas_lab.lessons.exercises.lesson03 import (
    check_boundary_steps,
    check_managed_loop,
    check_variable_window,
)


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    without_launcher_env(monkeypatch)


SOL = load_solutions(3)
CHECKS = [
    (check_boundary_steps, SOL.boundary_steps),
    (check_managed_loop, SOL.managed_loop),
    (check_variable_window, SOL.variable_window),
]


@pytest.mark.parametrize(("check", "solution"), CHECKS)
def test_solution_passes(check, solution):
    verdict = check(solution).raise_if_failed()
    assert verdict.status == "passed" and verdict.cases_passed == verdict.cases_total >= 2


@pytest.mark.parametrize(("check", "_solution"), CHECKS)
def test_untouched_stub_is_todo(check, _solution):
    assert_todo(check(todo))


# ---------------------------------------------------------------- exercise 1
def test_boundary_off_by_one_is_named():
    verdict = check_boundary_steps(lambda gas, calls: [k % gas == 0 for k in range(calls)])
    assert_failed(verdict, "GAS 3, 7 calls", "U..U..U", "..U..U.", "first update is at call 1")
    assert verdict.cases_passed == 1  # with GAS 1 every call updates either way


def test_boundary_wrong_length_is_caught():
    assert_failed(check_boundary_steps(lambda gas, calls: [True]), "GAS 1, 3 calls", "got U,")


# ---------------------------------------------------------------- exercise 2
def test_managed_loop_step_once_per_window_is_named():
    def step_once(engine, micro_batches, loss_fn):
        for x, y in micro_batches:
            engine.backward(loss_fn(engine(x), y))
        engine.step()

    assert_failed(
        check_managed_loop(step_once), "GAS 3, 2 windows", "micro_steps is 2", "every backward"
    )


def test_managed_loop_double_division_is_named():
    def divide_again(engine, micro_batches, loss_fn):
        for x, y in micro_batches:
            engine.backward(loss_fn(engine(x), y) / len(micro_batches))
            engine.step()

    verdict = check_managed_loop(divide_again)
    assert_failed(verdict, "GAS 3, 2 windows", "3x too small", "do not divide again")
    assert verdict.cases_passed == 1  # GAS 1: dividing by 1 twice is harmless


def test_managed_loop_plain_backward_is_refused():
    def plain_backward(engine, micro_batches, loss_fn):
        for x, y in micro_batches:
            loss_fn(engine(x), y).backward()
            engine.step()

    # Refused at ZeRO stage 0 from inside loss.backward(), as by DeepSpeed: the first case.
    assert_failed(
        check_managed_loop(plain_backward),
        "GAS 1, 2 windows",
        "RejectedCombination",
        "loss.backward()",
    )


def test_managed_loop_unscaled_backward_is_named():
    def unscaled(engine, micro_batches, loss_fn):
        for x, y in micro_batches:
            engine.backward(loss_fn(engine(x), y), scale_wrt_gas=False)
            engine.step()

    assert_failed(check_managed_loop(unscaled), "GAS 3, 2 windows", "3x too large")


# ---------------------------------------------------------------- exercise 3
def test_variable_window_default_scaling_is_named():
    def default_scale(engine, micro_batches, loss_fn):
        n = len(micro_batches)
        for i, (x, y) in enumerate(micro_batches):
            engine.set_gradient_accumulation_boundary(i == n - 1)
            engine.backward(loss_fn(engine(x), y))
        engine.step()

    assert_failed(
        check_variable_window(default_scale),
        "GAS 2, windows of [3, 1, 2] micro-batches",
        "divided by GAS = 2",
        "scale_wrt_gas=False",
    )


def test_variable_window_without_the_boundary_is_named():
    def never_boundary(engine, micro_batches, loss_fn):
        for x, y in micro_batches:
            engine.set_gradient_accumulation_boundary(False)
            engine.backward(loss_fn(engine(x), y) / len(micro_batches), scale_wrt_gas=False)
        engine.step()

    assert_failed(
        check_variable_window(never_boundary),
        "GAS 2, windows of [3, 1, 2] micro-batches",
        "no update",
    )


def test_variable_window_stepping_every_micro_batch_is_named():
    def step_each(engine, micro_batches, loss_fn):
        engine.set_gradient_accumulation_boundary(True)
        for x, y in micro_batches:
            engine.backward(loss_fn(engine(x), y) / len(micro_batches), scale_wrt_gas=False)
            engine.step()

    assert_failed(
        check_variable_window(step_each),
        "GAS 2, windows of [3, 1, 2] micro-batches",
        "6 updates for 3",
    )
