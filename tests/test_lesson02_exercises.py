"""Lesson 02 checkers: solutions pass, untouched stubs are 'todo', typical mistakes are named."""

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

from gas_lab.lessons.exercises.lesson02 import (
    buckets,
    check_bucketed_average,
    check_replicas,
    drifting_replicas,
)

SOL = load_solutions(2)


def test_bucket_rule():
    assert buckets([128, 32, 64, 8], 1 << 20) == [232]
    assert buckets([128, 32, 64, 8], 128) == [128, 104]
    assert buckets([128, 32, 64, 8], 100) == [128, 96, 8]
    assert buckets([128, 32, 64, 8], 40) == [128, 32, 64, 8]
    # A tensor that fills the bucket exactly still fits; "<" for "<=" closes it one too early.
    assert buckets([128, 32, 64, 8], 160) == [160, 72]
    assert buckets([128, 32, 64, 8], 160, exact_fit=False) == [128, 104]


@pytest.mark.ranks
@pytest.mark.parametrize(
    ("check", "solution"),
    [(check_bucketed_average, SOL.bucketed_average), (check_replicas, SOL.train_replicas)],
)
def test_solutions_pass_and_stubs_are_todo(cluster, check, solution):
    verdict = check(solution, cluster).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total >= 2
    assert_todo(check(todo, cluster))


# ---------------------------------------------------------------- exercise 1
def _per_tensor(grads, bucket_bytes):
    import torch.distributed as dist

    for g in grads:
        dist.all_reduce(g)
        g /= dist.get_world_size()


def _no_copy_back(grads, bucket_bytes):
    import torch
    import torch.distributed as dist

    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()


def _sum(grads, bucket_bytes):
    import torch.distributed as dist

    for g in grads:
        dist.all_reduce(g)


def _closes_exact_fit(grads, bucket_bytes):
    import torch
    import torch.distributed as dist

    groups, size = [], 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if groups and size + nbytes < bucket_bytes:  # the slip: < where the rule allows ==
            groups[-1].append(g)
            size += nbytes
        else:
            groups.append([g])
            size = nbytes
    for group in groups:
        flat = torch.cat([g.reshape(-1) for g in group])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for g, piece in zip(group, flat.split([g.numel() for g in group]), strict=True):
            g.copy_(piece.view_as(g))


def _always_one_bucket(grads, bucket_bytes):
    import torch.distributed as dist

    from gas_lab.dp import all_reduce_mean

    all_reduce_mean(grads, dist.group.WORLD)  # the lesson's one flat buffer, whatever the cap


@pytest.mark.ranks
def test_bucket_mistakes_are_named(cluster):
    assert_failed(
        first_try(check_bucketed_average, _per_tensor, cluster),
        "one bucket holds everything",
        "one all-reduce per tensor",
        "[232]",
    )
    assert_failed(
        first_try(check_bucketed_average, _no_copy_back, cluster),
        "one bucket holds everything",
        "unchanged",
    )
    verdict = first_try(check_bucketed_average, _sum, cluster)
    assert_failed(verdict, "one bucket holds everything", "2x the average")
    assert "divide" not in str(verdict)  # what differs on a first try, not the fix ...
    reset_tries()
    assert_hint_on_second_try(  # ... which a second wrong try gives
        lambda: check_bucketed_average(_sum, cluster), "divide the sum by the world size"
    )
    verdict = first_try(check_bucketed_average, _always_one_bucket, cluster)
    assert_failed(verdict, "128-byte buckets", "a bucket of 232 bytes is larger")
    assert verdict.cases_passed == 1
    assert "Look again at: *Averaging gradients, inline*" in str(verdict)


@pytest.mark.ranks
def test_a_bucket_that_fits_exactly_is_not_closed_early(cluster):
    verdict = first_try(check_bucketed_average, _closes_exact_fit, cluster)
    assert_failed(verdict, "160-byte buckets", "[128, 104]", "[160, 72]")
    assert verdict.cases_passed == 2  # every other bucket size never fills a bucket exactly
    reset_tries()
    assert_hint_on_second_try(lambda: check_bucketed_average(_closes_exact_fit, cluster), "LARGER")


# ---------------------------------------------------------------- exercise 2
def _every_rank_seeded_as_rank_1(steps, n, lr=0.1):  # equal replicas, rank 1's weights
    import torch

    from gas_lab.lessons.exercises import lesson02

    seed = torch.manual_seed
    torch.manual_seed = lambda _: seed(lesson02.SEED + 1)  # what drifting_replicas calls
    try:
        return lesson02.drifting_replicas(steps, n, lr)
    finally:
        torch.manual_seed = seed


def _reduce_per_parameter(steps, n, lr=0.1):
    import torch
    import torch.distributed as dist

    from gas_lab.lessons.exercises.lesson02 import SEED
    from gas_lab.toys import flat_params, micro_batch, tiny_model

    rank, model = dist.get_rank(), tiny_model(SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        for m in range(n):
            x, y = micro_batch(SEED, step, m, rank, 2)
            (torch.nn.functional.mse_loss(model(x), y) / n).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        optimizer.step()
        optimizer.zero_grad()
    return flat_params(model)


@pytest.mark.ranks
def test_the_given_loop_is_measured_and_explained(cluster):
    verdict = check_replicas(drifting_replicas, cluster)
    assert_failed(
        verdict,
        "1 step(s) of 2 micro-batches",
        "apart after 1 steps",
        "exactly as far as their weights were before the first step",
    )
    assert "broadcast" not in str(verdict)
    reset_tries()
    assert_hint_on_second_try(lambda: check_replicas(drifting_replicas, cluster), "START equal")


@pytest.mark.ranks
def test_replica_mistakes_are_named(cluster):
    assert_failed(
        first_try(check_replicas, _every_rank_seeded_as_rank_1, cluster),
        "1 step(s) of 2 micro-batches",
        "the ranks agree",
        "rank 0's initial weights",
    )
    assert_failed(
        first_try(check_replicas, _reduce_per_parameter, cluster),
        "1 step(s) of 2 micro-batches",
        "right parameters, but 4 all-reduces in 1 steps",
    )
