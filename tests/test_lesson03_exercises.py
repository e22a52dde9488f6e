"""Lesson 03 checkers: solutions pass, untouched stubs are 'todo', typical mistakes are named."""

import pytest
from exercise_support import assert_failed, assert_todo, load_solutions, todo

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
    ("wrong", "words"),
    [
        (_symmetric, ["[3, 6, 9, 12]", "waited for the next epoch"]),
        (_override_for_the_remainder, ["every call updates", "sticky"]),
        (_reset_after_the_remainder, ["The first epoch is right", "shifted"]),
        (_scaled_by_gas, ["right micro-batches", "1/N", "scale_wrt_gas=False"]),
    ],
)
def test_epoch_mistakes_are_named(wrong, words):
    verdict = check_epochs(wrong)
    assert_failed(verdict, "epochs of 7 and 5 micro-batches", *words)
    assert verdict.cases_passed == 1  # without a remainder every one of them is right


# ---------------------------------------------------------------- exercise 1 (DeepSpeed, ranks)
@pytest.mark.ranks
def test_predictions_solution_passes_and_stub_is_todo(cluster):
    verdict = check_counter_predictions(SOL.counter_predictions, cluster).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total == len(SCRIPTS)
    assert_todo(check_counter_predictions(todo, cluster))


@pytest.mark.ranks
@pytest.mark.parametrize(
    ("letter", "wrong", "words"),
    [
        ("A", (10, 2, 16), ["world size is missing", "16"]),
        ("D", (5, 0, 0), ["counts step() calls, not backward()"]),
        ("C", (8, 1, 32), ["DeepSpeed measured (8, 1, 16)", "train_batch_size = 16"]),
        ("B", (8, 1, 16), ["None hands the boundary back"]),
    ],
)
def test_wrong_predictions_are_explained(cluster, letter, wrong, words):
    answers = {**SOL.counter_predictions(), letter: wrong}
    assert_failed(check_counter_predictions(lambda: answers, cluster), f"script {letter}", *words)


@pytest.mark.ranks
def test_malformed_predictions_are_reported(cluster):
    verdict = check_counter_predictions(lambda: {**SOL.counter_predictions(), "E": 8}, cluster)
    assert_failed(verdict, "script E", "answer a tuple")
    assert "TypeError" in check_counter_predictions(lambda: [1, 2], cluster).message
