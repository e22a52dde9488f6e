"""Lesson 04 checkers: solutions pass, untouched stubs are 'todo', classic mistakes fail loudly."""

import pytest
from exercise_support import assert_failed, assert_todo, load_solutions, todo, without_launcher_env

from gas_lab.lessons.exercises.lesson04 import check_loss_divisor, check_rpc_step


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    without_launcher_env(monkeypatch)


SOL = load_solutions(4)


# ---------------------------------------------------------------- exercise 1 (one process)
def test_rpc_step_solution_passes_and_stub_is_todo():
    verdict = check_rpc_step(SOL.rpc_step).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total == 2
    assert_todo(check_rpc_step(todo))


def _default_scale(engine, micro_batches, loss_fn):
    for x, y in micro_batches:
        engine.backward(loss_fn(engine(x), y))
    engine.step()


def _step_every_micro_batch(engine, micro_batches, loss_fn):
    for x, y in micro_batches:
        engine.backward(loss_fn(engine(x), y) / len(micro_batches), scale_wrt_gas=False)
        engine.step()


def _plain_backward(engine, micro_batches, loss_fn):
    for x, y in micro_batches:
        (loss_fn(engine(x), y) / len(micro_batches)).backward()
    engine.step()


def test_rpc_step_default_scaling_is_named():
    verdict = check_rpc_step(_default_scale)
    assert_failed(verdict, "steps of [3, 5, 2] micro-batches (GAS 4)", "divided by GAS = 4", "N/4")
    assert verdict.cases_passed == 1  # N == GAS: the default is right


def test_rpc_step_stepping_every_micro_batch_is_named():
    assert_failed(
        check_rpc_step(_step_every_micro_batch),
        "steps of [4] micro-batches (GAS 4)",
        "4 optimizer updates for 1 steps",
        "EVERY step() updates",
    )


def test_rpc_step_plain_backward_is_refused():
    # Refused at ZeRO stage 0 from inside loss.backward(), as by DeepSpeed.
    assert_failed(
        check_rpc_step(_plain_backward),
        "steps of [4] micro-batches (GAS 4)",
        "RejectedCombination",
        "loss.backward()",
    )


# ---------------------------------------------------------------- exercise 2 (2 ranks)
def _own_count(n):
    return n


def _global_count_only(n):
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(n)])
    dist.all_reduce(total)
    return total.item()


@pytest.mark.ranks
def test_loss_divisor_solution_passes_and_stub_is_todo(cluster):
    verdict = check_loss_divisor(SOL.loss_divisor, cluster).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total == 3
    assert_todo(check_loss_divisor(todo, cluster))


@pytest.mark.ranks
def test_loss_divisor_own_count_is_named(cluster):
    verdict = check_loss_divisor(_own_count, cluster)
    assert_failed(
        verdict,
        "N differs between ranks",
        "rank 0: 3, rank 1: 1",
        "every RANK weighs the same",
        "off by",
    )
    assert verdict.cases_passed == 1  # equal N on every rank: the own count is right


@pytest.mark.ranks
def test_loss_divisor_missing_world_size_is_named(cluster):
    assert_failed(
        check_loss_divisor(_global_count_only, cluster),
        "same N on every rank",
        "2x too small",
        "global count / world size",
    )
