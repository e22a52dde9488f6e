"""Lesson 08 checkers: solutions pass, untouched stubs are 'todo', typical mistakes fail with
what differs (the fix held back for a second try). All on one process (the checkers build
world-size-1 gas_lab engines)."""

import tempfile
from pathlib import Path

import pytest
from exercise_support import (
    assert_failed,
    assert_hint_on_second_try,
    assert_todo,
    first_try,
    load_solutions,
    reset_tries,
    todo,
    without_launcher_env,
)

from gas_lab.lessons.exercises.lesson08 import (
    check_resume_position,
    check_sum_loss,
    check_token_count,
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


def no_gas(tl, mask, rank_tokens, all_tokens, world_size, gas):
    return (tl * mask).sum() / all_tokens


def test_forgetting_gas_says_the_size_and_hints_the_division():
    verdict = first_try(check_sum_loss, no_gas)
    assert_failed(verdict, "1 rank, GAS 4", "0.25 x its size", "expected 1 x")
    assert "multiply" not in str(verdict)
    reset_tries()
    assert_hint_on_second_try(
        lambda: check_sum_loss(no_gas), "divides every loss", "multiply by gas"
    )


def test_keeping_times_world_size_is_named():
    def times_w(tl, mask, rank_tokens, all_tokens, world_size, gas):
        return (tl * mask).sum() / all_tokens * gas * world_size

    verdict = first_try(check_sum_loss, times_w)
    assert_failed(verdict, "2 ranks, GAS 4", "2 x its size")
    assert verdict.cases_passed == 1  # one rank: W = 1 hides it
    assert "nothing divides by world_size" in verdict.hint()


def test_rank_tokens_points_elsewhere():
    def local(tl, mask, rank_tokens, all_tokens, world_size, gas):
        return (tl * mask).sum() / rank_tokens * gas

    verdict = first_try(check_sum_loss, local)
    assert_failed(verdict, "2 ranks, GAS 4", "points elsewhere")
    assert "all_tokens" in verdict.hint()


# ---------------------------------------------------------------- exercise 2
CASE_MID = "steps of 3, 1, 4, 2 micro-batches, saved mid step 2"


def _checkpoints_left() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("lesson08_*"))


def test_resume_solution_passes():
    before = _checkpoints_left()
    verdict = check_resume_position(SOL.resume_position).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total == 3
    assert _checkpoints_left() == before  # each case's checkpoint folder is removed


def test_resume_todo():
    assert_todo(check_resume_position(todo))


def test_skipping_the_open_window_says_which_micro_batches_never_run():
    # 2 x GAS (= 8) here: what the old judge wrongly called "assumes every step had GAS
    # micro-batches". Whatever the learner computed, 8 skips step 2 (micro-batches 4 to 7).
    def eight(global_steps, sizes):
        return 8

    verdict = first_try(check_resume_position, eight)
    assert_failed(verdict, CASE_MID, "micro-batches 4 to 7 never run", "step 2 was open")
    assert "GAS" not in str(verdict) and "gradient_accumulation_steps" not in str(verdict)
    reset_tries()
    assert_hint_on_second_try(lambda: check_resume_position(eight), "redo that window")


def test_past_the_save_point_is_described_not_crashed():
    def nine(global_steps, sizes):
        return 9  # one past the save: the old judge said "ends None away"

    verdict = first_try(check_resume_position, nine)
    assert_failed(verdict, CASE_MID, "micro-batches 4 to 8 never run")
    assert "None" not in verdict.message


def test_continuing_where_it_stopped_is_named():
    def where_saved(global_steps, sizes):
        return sum(sizes[:global_steps]) + 2  # the two micro-batches run in the open window

    verdict = first_try(check_resume_position, where_saved)
    assert_failed(verdict, CASE_MID, "micro-batches 4 to 5 never run")


def test_replaying_an_applied_step_says_which_run_twice():
    def one_step_back(global_steps, sizes):
        return sum(sizes[: global_steps - 1])

    verdict = first_try(check_resume_position, one_step_back)
    assert_failed(verdict, CASE_MID, "micro-batch 3 runs twice")
    assert "global_steps counts the steps" in verdict.hint()


def test_out_of_range_is_said_plainly():
    verdict = first_try(check_resume_position, lambda g, sizes: -1)
    assert_failed(verdict, CASE_MID, "returned -1", "0 to 9")


# ---------------------------------------------------------------- exercise 3
CASE_3 = "ragged updates, saved after 3"


def test_token_count_solution_passes():
    before = _checkpoints_left()
    verdict = check_token_count(SOL.token_count).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total == 2
    assert _checkpoints_left() == before


def test_token_count_todo():
    assert_todo(check_token_count(todo))


@pytest.mark.parametrize(
    "wrong, hint_words",
    [
        (lambda e, n: e.global_steps * n, ["counts updates"]),
        (lambda e, n: e.lr_scheduler.last_batch_iteration * n, ["undo the - 1"]),
        (lambda e, n: 0, ["restarted at 0"]),
    ],
    ids=["global_steps", "off by one", "restart"],
)
def test_typical_token_counts_fail_with_what_differs(wrong, hint_words):
    verdict = first_try(check_token_count, wrong)
    # 340 tokens: 30 + 250 + 60, the updates before the save
    assert_failed(verdict, CASE_3, "where the run had seen 340", "uninterrupted run")
    reset_tries()
    assert_hint_on_second_try(lambda: check_token_count(wrong), *hint_words)


def test_a_count_right_by_coincidence_in_one_run_only_gets_no_named_mistake():
    # Right for the first case's numbers only (340 = 3 updates' tokens there): fails the second
    # case, where 340 matches none of the engine's other counts, so no mistake is named.
    verdict = first_try(check_token_count, lambda e, n: 340)
    assert_failed(verdict, "ragged updates, saved after 4", "resumed at 340 tokens")
    assert verdict.cases_passed == 1
    assert verdict.hint().startswith("Hint: the loaded engine's lr_scheduler")
