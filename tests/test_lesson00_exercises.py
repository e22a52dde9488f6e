"""Lesson 00 checker: the solution passes, the TODO stub is 'todo', a sum instead of a mean fails."""

import pytest
from exercise_support import assert_failed, assert_todo, load_solutions, todo

from gas_lab.lessons.exercises.lesson00 import check_losses_from_all_ranks, check_mean_across_ranks

SOL = load_solutions(0)
pytestmark = pytest.mark.ranks


def _sum_instead_of_mean(x):
    import torch.distributed as dist

    dist.all_reduce(x)
    return x


def test_solution_passes(cluster):
    check_mean_across_ranks(SOL.mean_across_ranks, cluster).raise_if_failed()


def test_untouched_todo_is_reported_not_raised(cluster):
    assert_todo(check_mean_across_ranks(todo, cluster))


def test_sum_instead_of_mean_fails_with_a_precise_message(cluster):
    assert_failed(
        check_mean_across_ranks(_sum_instead_of_mean, cluster),
        "one number per rank",
        "that is the sum: divide by the world size",
    )


def _only_my_loss(loss):
    return [loss]


def test_gather_solution_passes(cluster):
    check_losses_from_all_ranks(SOL.losses_from_all_ranks, cluster).raise_if_failed()


def test_gather_todo_is_reported_not_raised(cluster):
    assert_todo(check_losses_from_all_ranks(todo, cluster))


def test_gather_returning_only_this_ranks_loss_is_named(cluster):
    assert_failed(
        check_losses_from_all_ranks(_only_my_loss, cluster),
        "losses 0.5, 1.5, ...",
        "returned only its own loss",
    )
