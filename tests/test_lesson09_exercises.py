"""Lesson 09 checkers: solutions pass, untouched
stubs are 'todo', typical mistakes are named on a first try without the fix, and the fix comes
on the second try."""

import copy

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

from gas_lab.lessons.exercises.lesson09 import (
    check_sum_weight,
    check_traffic_predictions,
)

SOL = load_solutions(9)


# ---------------------------------------------------------------- exercise 1 (ranks)
@pytest.mark.ranks
def test_traffic_solution_passes_and_stub_is_todo(cluster):
    verdict = check_traffic_predictions(SOL.traffic_predictions, cluster).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total == 4
    assert_todo(check_traffic_predictions(todo, cluster))


def _changed(letter, kind, value):
    answers = copy.deepcopy(SOL.traffic_predictions())
    answers[letter][kind] = value

    def predictions():
        return answers

    return predictions


@pytest.mark.ranks
@pytest.mark.parametrize(
    "letter, kind, value, differs, fix",
    [
        ("A", "all_reduce", (4, 3 * 232 + 4), "all_reduce: too few calls",
         "more than one all-reduce"),  # one per backward
        ("B", "all_reduce", (1, 4), "all_reduce: too few bytes", "float64"),
        ("C", "all_reduce", (2, 2 * 148), "all_reduce: too few calls",
         "even with gradient_clipping 0"),
        ("C", "all_gather", (1, 148), "all_gather: too few bytes", "PADDED"),
        ("D", "all_gather", (1, 232), "all_gather: too few calls", "one tensor at a time"),
    ],
)  # fmt: skip
def test_typical_traffic_mistakes_are_named(cluster, letter, kind, value, differs, fix):
    verdict = first_try(check_traffic_predictions, _changed(letter, kind, value), cluster)
    assert_failed(verdict, f"run {letter}", differs)
    for calls, nbytes in SOL.traffic_predictions()[letter].values():  # nothing to copy
        assert f"({calls}, {nbytes})" not in verdict.message
    reset_tries()
    wrong = _changed(letter, kind, value)
    assert_hint_on_second_try(lambda: check_traffic_predictions(wrong, cluster), fix)


# ---------------------------------------------------------------- exercise 2 (ranks)
@pytest.mark.ranks
def test_sum_weight_solution_passes_and_stub_is_todo(cluster):
    verdict = check_sum_weight(SOL.sum_weight, cluster).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total == 2
    assert_todo(check_sum_weight(todo, cluster))


def _mean_weight(real, n, total, world):  # lesson 09's weight, for the mean
    return world / total if real else 0.0


def _per_rank(real, n, total, world):
    return 1.0 / n if real else 0.0


def _padding_counts(real, n, total, world):
    return 1.0 / total


@pytest.mark.ranks
@pytest.mark.parametrize(
    "fn, differs, fix",
    [
        (_mean_weight, "W times the mean", "does not divide by W"),
        (_per_rank, "its own rank's count", "whichever rank ran it"),
        (_padding_counts, "adds to the update", "weigh it 0"),
    ],
)
def test_typical_weight_mistakes_are_named(cluster, fn, differs, fix):
    verdict = first_try(check_sum_weight, fn, cluster)
    assert_failed(verdict, "ranks with 2 and 1, then 1 and 3 micro-batches", differs)
    assert "Look again at: section 8" in verdict.details[0]
    reset_tries()
    assert_hint_on_second_try(lambda: check_sum_weight(fn, cluster), fix)
