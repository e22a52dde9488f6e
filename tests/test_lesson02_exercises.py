"""Lesson 02 checkers: solutions pass, untouched stubs are 'todo', classic mistakes fail loudly."""

import contextlib

import pytest
from exercise_support import assert_failed, assert_todo, load_solutions, todo

from gas_lab.lessons.exercises.lesson02 import (
    check_average_gradients,
    check_ddp_accumulation_step,
    check_gas_for,
)

SOL = load_solutions(2)


# ---------------------------------------------------------------- exercise 3 (one process)
def test_gas_for_solution_passes():
    verdict = check_gas_for(SOL.gas_for).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total == 4


def test_gas_for_stub_is_todo():
    assert_todo(check_gas_for(todo))


def test_gas_for_forgetting_the_world_size_is_named():
    assert_failed(
        check_gas_for(lambda b, m, w: b // m), "global 16, micro 2, world 2", "world size"
    )


def test_gas_for_rounding_down_instead_of_refusing_is_caught():
    verdict = check_gas_for(lambda b, m, w: b // (m * w))
    assert_failed(verdict, "global 12, micro 2, world 4", "returned 1", "1.5", "ValueError")
    assert verdict.cases_passed == 2


# ---------------------------------------------------------------- exercises 1 and 2 (2 ranks)
def _sum_only(model):
    import torch.distributed as dist

    for p in model.parameters():
        dist.all_reduce(p.grad)


def _no_communication(model):
    pass


def _naive(model, optimizer, micro_batches, loss_fn):
    for x, y in micro_batches:
        (loss_fn(model(x), y) / len(micro_batches)).backward()
    optimizer.step()
    optimizer.zero_grad()


def _no_sync_around_backward_only(model, optimizer, micro_batches, loss_fn):
    n = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        loss = loss_fn(model(x), y) / n  # forward OUTSIDE no_sync: the documented trap
        with model.no_sync() if i < n - 1 else contextlib.nullcontext():
            loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _never_syncs(model, optimizer, micro_batches, loss_fn):
    with model.no_sync():
        for x, y in micro_batches:
            (loss_fn(model(x), y) / len(micro_batches)).backward()
    optimizer.step()
    optimizer.zero_grad()


def _forgot_divide(model, optimizer, micro_batches, loss_fn):
    n = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        with model.no_sync() if i < n - 1 else contextlib.nullcontext():
            loss_fn(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.ranks
def test_rank_solutions_pass_and_stubs_are_todo(cluster):
    for check, solution in (
        (check_average_gradients, SOL.average_gradients),
        (check_ddp_accumulation_step, SOL.ddp_accumulation_step),
    ):
        verdict = check(solution, cluster).raise_if_failed()
        assert verdict.cases_passed == verdict.cases_total == 2
        assert_todo(check(todo, cluster))


@pytest.mark.ranks
def test_average_gradients_mistakes_are_named(cluster):
    assert_failed(
        check_average_gradients(_sum_only, cluster), "batch seed 0", "2x", "SUM", "world size"
    )
    assert_failed(
        check_average_gradients(_no_communication, cluster),
        "batch seed 0",
        "its own gradient",
        "no all-reduce",
    )


def _grad_of_the_wrong_thing(model):
    import torch.distributed as dist

    for p in model.parameters():
        dist.all_reduce(p.grad.grad)  # .grad of a gradient is None: all_reduce refuses it


@pytest.mark.ranks
def test_average_gradients_error_on_a_rank_is_reported(cluster):
    verdict = check_average_gradients(_grad_of_the_wrong_thing, cluster)
    assert verdict.status == "failed", verdict.message
    assert "raised RankFailure: on rank 0:" in verdict.message, verdict.message


@pytest.mark.ranks
def test_ddp_step_mistakes_are_named(cluster):
    for wrong in (_naive, _no_sync_around_backward_only):
        verdict = check_ddp_accumulation_step(wrong, cluster)
        assert_failed(verdict, "N = 3 micro-batches", "right parameters", "3 all-reduces")
        assert "forward as well as the backward" in verdict.message
        assert verdict.cases_passed == 1  # with N = 1 every loop reduces exactly once
    assert_failed(
        check_ddp_accumulation_step(_never_syncs, cluster),
        "N = 1 micro-batches",
        "drifted apart",
        "0 all-reduces",
    )
    assert_failed(
        check_ddp_accumulation_step(_forgot_divide, cluster),
        "N = 3 micro-batches",
        "3x too large",
    )
