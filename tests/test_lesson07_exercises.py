"""Lesson 07 checkers: solutions pass, untouched stubs are 'todo', typical mistakes are named."""

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

from gas_lab.lessons.exercises.lesson07 import (
    CachedCountTrainer,
    check_sequence_mean_loss,
    check_trainer,
)

SOL = load_solutions(7)


# ---------------------------------------------------------------- exercise 1 (one process)
def test_sequence_mean_solution_passes():
    verdict = check_sequence_mean_loss(SOL.sequence_mean_loss).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total == 3


def test_sequence_mean_todo():
    assert_todo(check_sequence_mean_loss(todo))


def _token_mean(tl, mask, rank_sequences, all_sequences, all_tokens, world_size):
    return (tl * mask).sum() / all_tokens * world_size  # the capstone's own objective


def _own_sequences(tl, mask, rank_sequences, all_sequences, all_tokens, world_size):
    return ((tl * mask).sum(1) / mask.sum(1)).sum() / rank_sequences


def _no_world(tl, mask, rank_sequences, all_sequences, all_tokens, world_size):
    return ((tl * mask).sum(1) / mask.sum(1)).sum() / all_sequences


def _detached(tl, mask, rank_sequences, all_sequences, all_tokens, world_size):
    return SOL.sequence_mean_loss(
        tl, mask, rank_sequences, all_sequences, all_tokens, world_size
    ).detach()


def _micro_batch_mean(tl, mask, rank_sequences, all_sequences, all_tokens, world_size):
    return (tl * mask).sum() / mask.sum() * len(mask) / all_sequences * world_size


@pytest.mark.parametrize(
    ("wrong", "case", "words", "hint_words"),
    [
        (_token_mean, "1 rank", ["long sequences weigh more", "off by"], ["own real tokens"]),
        (_own_sequences, "2 ranks with very different token counts", ["ranks of different"],
         ["all_sequences"]),
        (_no_world, "2 ranks with very different token counts", ["1/2", "right direction"],
         ["AVERAGES", "world_size"]),
        (_micro_batch_mean, "1 rank", ["every token of a micro"],
         ["row's"]),
        (_detached, "1 rank", ["no gradient"], ["SEQUENCE"]),
    ],
)  # fmt: skip
def test_sequence_mean_mistakes_are_named_then_hinted(wrong, case, words, hint_words):
    """A first wrong try says what differs and where to look, never the fix (no formula, no
    world_size); the second try of the same answer shows the hint."""
    verdict = first_try(check_sequence_mean_loss, wrong)
    assert_failed(verdict, case, *words)
    assert any("section 1 (*The idea*)" in d for d in verdict.details)
    for fix in ("world_size", "all_sequences", "mask.sum(1)"):
        assert fix not in verdict.message
    reset_tries()
    assert_hint_on_second_try(lambda: check_sequence_mean_loss(wrong), *hint_words)


# ---------------------------------------------------------------- exercise 2 (on the ranks)
@pytest.mark.ranks
def test_trainer_solution_passes_and_stub_is_todo(cluster):
    verdict = check_trainer(SOL.Trainer, cluster).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total == 4
    assert_todo(check_trainer(todo, cluster))


@pytest.mark.ranks
def test_the_given_trainer_is_right_once_then_drifts(cluster):
    verdict = first_try(check_trainer, CachedCountTrainer, cluster)
    assert_failed(verdict, "after step 2 of 4", "drift from the reference", "Step 1 is right")
    assert "all-reduce" not in verdict.message  # the fix waits for the second try
    assert verdict.cases_passed == 1
    drift = verdict.message.split("after each step: ")[1].split(" (")[0].split(", ")
    assert float(drift[0]) < 1e-5 < float(drift[1])  # measured: right, then not
    second = check_trainer(CachedCountTrainer, cluster)
    assert any(d.startswith("Hint:") and "still comes from step 1" in d for d in second.details)
