"""Lesson 03 checkers: solutions pass, untouched stubs are 'todo', typical mistakes are named."""

import pytest
from exercise_support import (
    assert_failed,
    assert_hint_on_second_try,
    assert_todo,
    first_try,
    load_solutions,
    reset_tries,
    todo,
)

from gas_lab.lessons.exercises.lesson03 import SCRIPTS, check_counter_predictions, check_epochs

SOL = load_solutions(3)


# ---------------------------------------------------------------- exercise 2 (one process)
def test_epochs_solution_passes():
    verdict = check_epochs(SOL.train_epochs).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total == 3


def test_epochs_stub_is_todo():
    assert_todo(check_epochs(todo))


def _symmetric(engine, epochs, loss_fn):
    for micro_batches in epochs:
        for x, y in micro_batches:
            engine.backward(loss_fn(engine(x), y))
            engine.step()


def _override_for_the_remainder(engine, epochs, loss_fn, reset=False):
    gas = engine.gradient_accumulation_steps()
    for micro_batches in epochs:
        full = len(micro_batches) // gas * gas
        _symmetric(engine, [micro_batches[:full]], loss_fn)
        rest = micro_batches[full:]
        for i, (x, y) in enumerate(rest):
            engine.set_gradient_accumulation_boundary(i == len(rest) - 1)
            engine.backward(loss_fn(engine(x), y) / len(rest), scale_wrt_gas=False)
        if rest:
            engine.step()
        if reset:
            engine.set_gradient_accumulation_boundary(None)


def _reset_after_the_remainder(engine, epochs, loss_fn):
    _override_for_the_remainder(engine, epochs, loss_fn, reset=True)


def _scaled_by_gas(engine, epochs, loss_fn):
    gas = engine.gradient_accumulation_steps()
    for micro_batches in epochs:
        for start in range(0, len(micro_batches), gas):
            window = micro_batches[start : start + gas]
            for i, (x, y) in enumerate(window):
                engine.set_gradient_accumulation_boundary(i == len(window) - 1)
                engine.backward(loss_fn(engine(x), y))
            engine.step()


@pytest.mark.parametrize(
    ("wrong", "differs", "fix"),
    [
        (_symmetric, ["[3, 6, 9, 12]", "multiple of GAS"], ["waited for the next epoch"]),
        (_override_for_the_remainder, ["every call updates"], ["sticky", "None"]),
        (_reset_after_the_remainder, ["The first epoch is right", "shifted"], ["micro_steps"]),
        (_scaled_by_gas, ["right micro-batches"], ["1/N", "scale_wrt_gas=False"]),
    ],
)
def test_epoch_mistakes_say_what_differs_then_the_fix(wrong, differs, fix):
    verdict = first_try(check_epochs, wrong)
    assert_failed(verdict, "epochs of 7 and 5 micro-batches", *differs)
    assert "Look again at: *The manual override" in str(verdict)
    assert verdict.cases_passed == 1  # without a remainder every one of them is right
    reset_tries()
    assert_hint_on_second_try(lambda: check_epochs(wrong), *fix)


# ---------------------------------------------------------------- exercise 1 (DeepSpeed, ranks)
@pytest.mark.ranks
def test_predictions_solution_passes_and_stub_is_todo(cluster):
    verdict = check_counter_predictions(SOL.counter_predictions, cluster).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total == len(SCRIPTS)
    assert_todo(check_counter_predictions(todo, cluster))


@pytest.mark.ranks
@pytest.mark.parametrize(
    ("letter", "wrong", "differs", "fix"),
    [
        ("A", (10, 2, 16), ["global_samples (16)", "micro_steps and global_steps are right"],
         ["world size is missing"]),
        ("D", (5, 0, 0), ["micro_steps (5)"], ["counts step() calls, not backward()"]),
        ("C", (8, 1, 32), ["global_samples (32)"], ["train_batch_size = 16"]),
        ("B", (8, 1, 16), ["global_steps (1) and global_samples (16)"],
         ["None hands the boundary back"]),
    ],
)  # fmt: skip
def test_wrong_predictions_say_what_differs_then_why(cluster, letter, wrong, differs, fix):
    answers = {**SOL.counter_predictions(), letter: wrong}
    verdict = first_try(check_counter_predictions, lambda: answers, cluster)
    assert_failed(verdict, f"script {letter}", *differs)
    measured = SOL.counter_predictions()[letter]
    assert str(measured) not in str(verdict), "the first try must not give the answer"
    assert "Look again at: the counters table" in str(verdict)
    reset_tries()
    assert_hint_on_second_try(lambda: check_counter_predictions(lambda: answers, cluster), *fix)


@pytest.mark.ranks
def test_malformed_predictions_are_reported(cluster):
    verdict = check_counter_predictions(lambda: {**SOL.counter_predictions(), "E": 8}, cluster)
    assert_failed(verdict, "script E", "answer a tuple")
    assert "TypeError" in check_counter_predictions(lambda: [1, 2], cluster).message
