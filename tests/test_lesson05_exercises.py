"""Lesson 05 checkers: solutions pass, untouched stubs are 'todo', typical mistakes are named on a
first try without the fix, and the fix comes on the second try."""

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

from gas_lab.lessons.exercises.lesson05 import (
    TRAFFIC,
    check_shard_accumulation,
    check_traffic_predictions,
)

SOL = load_solutions(5)
pytestmark = pytest.mark.ranks


@pytest.mark.parametrize(
    ("check", "solution"),
    [
        (check_shard_accumulation, SOL.accumulate_shard),
        (check_traffic_predictions, SOL.traffic_predictions),
    ],
)
def test_solutions_pass_and_stubs_are_todo(cluster, check, solution):
    verdict = check(solution, cluster).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total >= 3
    assert_todo(check(todo, cluster))


# ---------------------------------------------------------------- exercise 1
def _accumulate_then_reduce(micro_grads, group):  # ZeRO-1's schedule: a whole local gradient
    import torch
    import torch.distributed as dist

    total = None
    for g in micro_grads:
        total = g if total is None else total + g
    out = torch.empty(total.numel() // dist.get_world_size(group))
    dist.reduce_scatter_tensor(out, total, group=group)
    return out / dist.get_world_size(group)


def _all_reduce_and_slice(micro_grads, group):  # right: the text never asks for reduce-scatter
    import torch.distributed as dist

    world, rank, shard = dist.get_world_size(group), dist.get_rank(group), 0
    for g in micro_grads:
        dist.all_reduce(g, group=group)
        size = g.numel() // world
        shard = shard + g[rank * size : (rank + 1) * size]
    return shard / world


def _sum(micro_grads, group):
    import torch
    import torch.distributed as dist

    shard = 0
    for g in micro_grads:
        out = torch.empty(g.numel() // dist.get_world_size(group))
        dist.reduce_scatter_tensor(out, g, group=group)
        shard = shard + out
    return shard


def _other_shard(micro_grads, group):
    import torch.distributed as dist

    world, rank, shard = dist.get_world_size(group), dist.get_rank(group), 0
    for g in micro_grads:
        dist.all_reduce(g, group=group)
        size = g.numel() // world
        other = (rank + 1) % world
        shard = shard + g[other * size : (other + 1) * size]
    return shard / world


def test_reducing_with_an_all_reduce_and_slicing_passes(cluster):
    check_shard_accumulation(_all_reduce_and_slice, cluster).raise_if_failed()


def test_reducing_once_at_the_end_is_named_for_its_schedule(cluster):
    verdict = first_try(check_shard_accumulation, _accumulate_then_reduce, cluster)
    assert_failed(verdict, "3 micro-batch(es), 58 elements", "the right shard", "taken before")
    assert verdict.cases_passed == 1  # one micro-batch: nothing to keep in between
    assert "Look again at: *Build it in steps*" in verdict.details[0]
    reset_tries()
    assert_hint_on_second_try(
        lambda: check_shard_accumulation(_accumulate_then_reduce, cluster), "inside the loop"
    )


@pytest.mark.parametrize(
    ("fn", "differs", "fix"),
    [
        (_sum, ["2x the average"], ["SUMS"]),
        (_other_shard, ["rank 1's shard", "expected [0, 30)"], ["rank r owns shard r"]),
    ],
)
def test_shard_mistakes_are_named(cluster, fn, differs, fix):
    verdict = first_try(check_shard_accumulation, fn, cluster)
    assert_failed(verdict, "1 micro-batch(es), 58 elements", *differs)
    for word in fix:
        assert word not in str(verdict) and word in verdict.hint()


# ---------------------------------------------------------------- exercise 2
def test_traffic_runs_are_described():
    assert "ZeRO stage 1" in TRAFFIC["C"].show() and "37 weights" in TRAFFIC["C"].show()
    assert "use_multi_rank_bucket_allreduce false" in TRAFFIC["E"].show()


@pytest.mark.parametrize(
    ("letter", "wrong", "differs", "fix"),
    [
        ("A", {"all_reduce": (2, 236)}, "all_reduce: too many calls", "stage 0 computes the norm"),
        ("B", {"all_reduce": (1, 232), "all_gather": (1, 240)}, "all_reduce: too few calls",
         "gradient_clipping 0.0"),
        ("C", {"all_reduce": (2, 152), "all_gather": (1, 148)}, "all_gather: too few bytes",
         "PADDED"),
        ("E", {"reduce": (1, 160), "all_reduce": (1, 4), "all_gather": (1, 160)},
         "reduce: too few calls", "one reduce per owner"),
    ],
)  # fmt: skip
def test_wrong_traffic_is_explained(cluster, letter, wrong, differs, fix):
    answers = {**SOL.traffic_predictions(), letter: wrong}
    verdict = first_try(check_traffic_predictions, lambda: answers, cluster)
    assert_failed(verdict, f"run {letter}", differs)
    measured = SOL.traffic_predictions()[letter]
    for calls, nbytes in measured.values():  # nothing measured to copy from the first answer
        assert f"({calls}, {nbytes})" not in verdict.message
    reset_tries()
    assert_hint_on_second_try(lambda: check_traffic_predictions(lambda: answers, cluster), fix)
