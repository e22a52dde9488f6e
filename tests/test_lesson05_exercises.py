"""Lesson 05 checkers: solutions pass, untouched stubs are 'todo', classic mistakes fail loudly."""

import pytest
from exercise_support import assert_failed, assert_todo, load_solutions, todo

from gas_lab.lessons.exercises.lesson05 import (
    check_global_norm,
    check_gradient_shard,
    check_shard_ranges,
)

SOL = load_solutions(5)


# ---------------------------------------------------------------- exercise 1 (no ranks)
def test_shard_range_solution_passes():
    verdict = check_shard_ranges(SOL.shard_range).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total == 5


def test_shard_range_todo():
    assert_todo(check_shard_ranges(todo))


def test_shard_range_without_padding_loses_elements():
    def floor(numel, world, rank):
        size = numel // world
        return rank * size, (rank + 1) * size

    # 58 / 2 divides evenly (and 29 is what a floor gives); 43 / 2 loses an element
    assert_failed(check_shard_ranges(floor), "numel 58, world size 2", "multiple of 2")
    assert check_shard_ranges(floor).cases_passed == 0


def test_shard_range_floor_is_named_where_elements_are_lost():
    def floor_aligned(numel, world, rank):
        size = numel // (2 * world) * 2
        return rank * size, (rank + 1) * size

    assert_failed(
        check_shard_ranges(floor_aligned), "numel 58, world size 2", "belong to no rank", "round up"
    )


def test_shard_range_unaligned_ceil_is_named():
    def ceil(numel, world, rank):
        size = -(-numel // world)
        return rank * size, (rank + 1) * size

    verdict = check_shard_ranges(ceil)
    assert_failed(verdict, "numel 58, world size 2", "not a multiple of 2")


# ---------------------------------------------------------------- exercises 2-3 (2 ranks)


@pytest.mark.ranks
def test_rank_solutions_pass(cluster):
    assert check_global_norm(SOL.global_grad_norm, cluster).raise_if_failed().cases_passed == 3
    assert check_gradient_shard(SOL.gradient_shard, cluster).raise_if_failed().cases_passed == 2


@pytest.mark.ranks
def test_rank_todos(cluster):
    assert_todo(check_global_norm(todo, cluster))
    assert_todo(check_gradient_shard(todo, cluster))


def _local_norm(shard, group):
    return shard.norm().item()


def _sum_of_norms(shard, group):
    import torch.distributed as dist

    norm = shard.norm()
    dist.all_reduce(norm, group=group)
    return norm.item()


def _squared(shard, group):
    import torch.distributed as dist

    squares = shard.pow(2).sum()
    dist.all_reduce(squares, group=group)
    return squares.item()


@pytest.mark.ranks
@pytest.mark.parametrize(
    "wrong, words",
    [
        (_local_norm, ["OWN shard", "all-reduce"]),
        (_sum_of_norms, ["SUM of the shards' norms", "squares do"]),
        (_squared, ["squared norm"]),
    ],
    ids=["local", "sum-of-norms", "no-root"],
)
def test_global_norm_mistakes_are_named(cluster, wrong, words):
    assert_failed(check_global_norm(wrong, cluster), "43 elements", *words)


def _summed_shard(flat, group):
    import torch
    import torch.distributed as dist

    out = torch.empty(flat.numel() // dist.get_world_size(group))
    dist.reduce_scatter_tensor(out, flat, group=group)
    return out


def _other_shard(flat, group):
    import torch.distributed as dist

    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    size = flat.numel() // dist.get_world_size(group)
    other = 1 - dist.get_rank(group)
    return flat[other * size : (other + 1) * size]


def _unreduced(flat, group):
    import torch.distributed as dist

    size = flat.numel() // dist.get_world_size(group)
    return flat[dist.get_rank(group) * size :][:size]


def _whole_vector(flat, group):
    import torch.distributed as dist

    dist.all_reduce(flat, group=group)
    return flat / dist.get_world_size(group)


@pytest.mark.ranks
@pytest.mark.parametrize(
    "wrong, words",
    [
        (_summed_shard, ["2x the mean", "divide by W"]),
        (_other_shard, ["returned rank 1's shard"]),
        (_unreduced, ["unreduced"]),
        (_whole_vector, ["60 elements", "its shard has 30"]),
    ],
    ids=["sum", "other-shard", "unreduced", "whole-vector"],
)
def test_gradient_shard_mistakes_are_named(cluster, wrong, words):
    assert_failed(check_gradient_shard(wrong, cluster), "58 elements", *words)
