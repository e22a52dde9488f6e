"""Lesson 09 checkers: solutions pass, untouched stubs are 'todo', typical mistakes are named."""

import copy

import pytest
from exercise_support import assert_failed, assert_todo, load_solutions, todo

from gas_lab.lessons.exercises.lesson09 import (
    check_lowest_stage,
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
    "letter, kind, value, words",
    [
        ("A", "all_reduce", (4, 3 * 232 + 4), ["more than one all-reduce"]),  # one per backward
        ("B", "all_reduce", (1, 4), ["float64"]),
        ("C", "all_reduce", (2, 2 * 148), ["even with gradient_clipping 0"]),
        ("C", "all_gather", (1, 148), ["PADDED"]),
        ("D", "all_gather", (1, 232), ["one tensor at a time"]),
    ],
)
def test_typical_traffic_mistakes_are_named(cluster, letter, kind, value, words):
    verdict = check_traffic_predictions(_changed(letter, kind, value), cluster)
    assert_failed(verdict, f"run {letter}", *words)


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
    "fn, words",
    [
        (_mean_weight, ["does not divide by W"]),
        (_per_rank, ["this rank's n"]),
        (_padding_counts, ["weigh it 0"]),
    ],
)
def test_typical_weight_mistakes_are_named(cluster, fn, words):
    verdict = check_sum_weight(fn, cluster)
    assert_failed(verdict, "ranks with 2 and 1, then 1 and 3 micro-batches", *words)


# ---------------------------------------------------------------- exercise 3 (one process)
def test_lowest_stage_solution_passes_and_stub_is_todo():
    verdict = check_lowest_stage(SOL.lowest_stage_that_fits).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total >= 5
    assert_todo(check_lowest_stage(todo))


def test_highest_stage_is_named():
    from gas_lab.measure.memory import project_census

    def highest(numel, world, budget):
        fits = [s for s in range(4) if sum(project_census(numel, world, s).values()) <= budget]
        return max(fits) if fits else None

    assert_failed(check_lowest_stage(highest), "7e+09 weights, 8 ranks, 8e+10 bytes", "LOWEST")


def test_strict_budget_is_named():
    from gas_lab.measure.memory import project_census

    def strict(numel, world, budget):
        for stage in range(4):
            if sum(project_census(numel, world, stage).values()) < budget:
                return stage
        return None

    verdict = check_lowest_stage(strict)
    assert_failed(verdict, "1e+09 weights, 2 ranks, 1.4e+10 bytes", "(<=)")
