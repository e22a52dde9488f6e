"""Lesson 05 checkers: solutions pass, untouched stubs are 'todo', typical mistakes are named."""

import pytest
from exercise_support import assert_failed, assert_todo, first_try, load_solutions, todo

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
def _accumulate_then_reduce(micro_grads, group):  # stage 1's schedule: a full local gradient
    import torch
    import torch.distributed as dist

    total = None
    for g in micro_grads:
        total = g if total is None else total + g
    out = torch.empty(total.numel() // dist.get_world_size(group))
    dist.reduce_scatter_tensor(out, total, group=group)
    return out / dist.get_world_size(group)


def _all_reduce_and_slice(micro_grads, group):
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


def test_shard_mistakes_are_named(cluster):
    verdict = first_try(check_shard_accumulation, _accumulate_then_reduce, cluster)
    assert_failed(verdict, "3 micro-batch(es), 58 elements", "asked for before", "reduce-scattered")
    assert verdict.cases_passed == 1  # one micro-batch: nothing to keep in between
    assert_failed(
        first_try(check_shard_accumulation, _all_reduce_and_slice, cluster),
        "1 micro-batch(es), 58 elements",
        "right shard, but 1 all-reduces",
        "WHOLE",
    )
    assert_failed(
        first_try(check_shard_accumulation, _sum, cluster), "1 micro-batch(es), 58 elements", "2x"
    )


# ---------------------------------------------------------------- exercise 2
def test_traffic_runs_are_described():
    assert "ZeRO stage 1" in TRAFFIC["C"].show() and "37 weights" in TRAFFIC["C"].show()


@pytest.mark.parametrize(
    ("letter", "wrong", "words"),
    [
        ("B", {"all_reduce": (1, 232), "all_gather": (1, 240)}, ["norm", "gradient_clipping 0.0"]),
        ("C", {"all_reduce": (2, 152), "all_gather": (1, 148)}, ["PADDED", "padded to 40"]),
        ("E", {"all_reduce": (2, 236), "all_gather": (1, 240)}, ["one step's traffic"]),
    ],
)
def test_wrong_traffic_is_explained(cluster, letter, wrong, words):
    answers = {**SOL.traffic_predictions(), letter: wrong}
    verdict = check_traffic_predictions(lambda: answers, cluster)
    assert_failed(verdict, f"run {letter}", "measured", *words)
