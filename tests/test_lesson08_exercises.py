"""Lesson 08 checkers: solutions pass, untouched stubs are 'todo', typical mistakes fail with
their message. All on one process (the checkers build world-size-1 gas_lab engines)."""

import pytest
from exercise_support import assert_failed, assert_todo, load_solutions, todo, without_launcher_env

from gas_lab.lessons.exercises.lesson08 import (
    check_resume_position,
    check_sum_loss,
    check_token_clock,
)

SOL = load_solutions(8)


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    without_launcher_env(monkeypatch)


# ---------------------------------------------------------------- exercise 1
def test_sum_loss_solution_passes():
    verdict = check_sum_loss(SOL.sum_loss).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total == 3


def test_sum_loss_todo():
    assert_todo(check_sum_loss(todo))


def test_forgetting_gas_is_named():
    def no_gas(tl, mask, rank_tokens, all_tokens, world_size, gas):
        return (tl * mask).sum() / all_tokens

    assert_failed(check_sum_loss(no_gas), "1 rank, GAS 4", "1/4", "divides by")


def test_keeping_times_world_size_is_named():
    def times_w(tl, mask, rank_tokens, all_tokens, world_size, gas):
        return (tl * mask).sum() / all_tokens * gas * world_size

    verdict = check_sum_loss(times_w)
    assert_failed(verdict, "2 ranks, GAS 4", "nothing divides by world_size")
    assert verdict.cases_passed == 1  # one rank: W = 1 hides it


def test_rank_tokens_is_named():
    def local(tl, mask, rank_tokens, all_tokens, world_size, gas):
        return (tl * mask).sum() / rank_tokens * gas

    assert_failed(check_sum_loss(local), "2 ranks, GAS 4", "not by this rank's")


# ---------------------------------------------------------------- exercise 2
def test_resume_solution_passes():
    verdict = check_resume_position(SOL.resume_position).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total == 3


def test_resume_todo():
    assert_todo(check_resume_position(todo))


def test_nominal_gas_is_named():
    def nominal(global_steps, sizes):
        return global_steps * 4

    assert_failed(check_resume_position(nominal), "steps of 3, 1, 4, 2 micro-batches, saved mid step 2", "assumes every step had GAS")  # fmt: skip


def test_continuing_where_it_stopped_is_named():
    def where_saved(global_steps, sizes):
        return sum(sizes[:global_steps]) + 2  # the two micro-batches run in the open window

    assert_failed(check_resume_position(where_saved), "steps of 3, 1, 4, 2 micro-batches, saved mid step 2", "were not saved", "Redo the window")  # fmt: skip


# ---------------------------------------------------------------- exercise 3
def test_token_clock_solution_passes():
    verdict = check_token_clock(SOL.token_clock).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total == 2


def test_token_clock_todo():
    assert_todo(check_token_clock(todo))


def test_one_update_ahead_is_named():
    def ahead(tokens, nominal):
        return {"last_batch_iteration": tokens / nominal}

    assert_failed(
        check_token_clock(ahead), "every update has the nominal tokens", "one update ahead"
    )


def test_counting_updates_fails_on_ragged_updates():
    def updates(tokens, nominal):
        return None  # DeepSpeed's own clock: one per update

    verdict = check_token_clock(updates)
    assert_failed(verdict, "ragged updates", "the token clock says")
    assert verdict.cases_passed == 1  # right when every update has the nominal tokens
