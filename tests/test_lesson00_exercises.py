"""Lesson 00 checkers: the solutions pass, the TODO stubs say 'todo', typical mistakes are named."""

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

from gas_lab.lessons.exercises.lesson00 import check_any_rank_overflowed, check_gather_ragged

SOL = load_solutions(0)
pytestmark = pytest.mark.ranks


@pytest.mark.parametrize(
    ("check", "solution"),
    [
        (check_gather_ragged, SOL.gather_ragged),
        (check_any_rank_overflowed, SOL.any_rank_overflowed),
    ],
)
def test_solutions_pass_and_stubs_are_todo(cluster, check, solution):
    verdict = check(solution, cluster).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total >= 3
    assert_todo(check(todo, cluster))


# ---------------------------------------------------------------- exercise 1
def _only_mine(x):
    return x


def _padding_left_in(x):
    import torch
    import torch.distributed as dist

    length = torch.tensor([x.numel()])
    lengths = [torch.zeros_like(length) for _ in range(dist.get_world_size())]
    dist.all_gather(lengths, length)
    padded = torch.zeros(int(max(lengths)))
    padded[: x.numel()] = x
    pieces = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(pieces, padded)
    return torch.cat(pieces)  # forgot to cut each piece to its length


def _unequal_all_gather(x):
    import torch
    import torch.distributed as dist

    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, x)  # gloo refuses pieces of another size
    return torch.cat(pieces)


def test_gather_mistakes_are_named(cluster):
    assert_failed(check_gather_ragged(_only_mine, cluster), "equal lengths", "only its own")
    verdict = check_gather_ragged(_padding_left_in, cluster)
    assert_failed(verdict, "a different length on every rank", "zeros no rank holds", "[2, 5]")
    assert "padding" not in verdict.message  # what differs, not the fix ...
    assert verdict.cases_passed == 1  # with equal lengths there is no padding to forget
    reset_tries()
    assert_hint_on_second_try(  # ... which the second wrong try gives
        lambda: check_gather_ragged(_padding_left_in, cluster), "padding is still in"
    )


def test_gather_of_unequal_sizes_is_explained_not_raised(cluster):
    # Equal lengths pass; unequal ones make gloo raise on a rank (and the ranks restart).
    verdict = check_gather_ragged(_unequal_all_gather, cluster)
    assert_failed(verdict, "a different length on every rank", "SAME size", "[2, 5]")
    assert verdict.cases_passed == 1
    assert cluster.run(lambda: 1) == [1, 1]  # usable again afterwards


# ---------------------------------------------------------------- exercise 2
def _own_loss_only(loss):
    import math

    return not math.isfinite(loss)


def _sum_of_losses(loss):
    import math

    import torch
    import torch.distributed as dist

    total = torch.tensor([float(loss)])
    dist.all_reduce(total)  # nan and inf propagate, but so does a float32 overflow
    return not math.isfinite(total.item())


def test_overflow_mistakes_are_named(cluster):
    verdict = check_any_rank_overflowed(_own_loss_only, cluster)
    assert_failed(verdict, "nan on the last rank only", "the ranks disagree", "[False, True]")
    assert verdict.cases_passed == 1
    assert "Look again at: section 5" in str(verdict)
    verdict = first_try(check_any_rank_overflowed, _sum_of_losses, cluster)
    assert_failed(verdict, "every loss finite, and huge", "every loss is finite")
    assert "overflow" not in verdict.message and "flag" not in verdict.message
    assert verdict.cases_passed == 3
    reset_tries()
    assert_hint_on_second_try(
        lambda: check_any_rank_overflowed(_sum_of_losses, cluster), "overflowed float32", "flag"
    )
