"""Lesson 07 checkers: solutions pass, untouched stubs are 'todo', typical mistakes are named."""

import pytest
from exercise_support import assert_failed, assert_todo, load_solutions, todo

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


def _per_token(tl, mask, rank_sequences, all_sequences, all_tokens, world_size):
    return (tl * mask).sum() / all_tokens * world_size  # the capstone's own objective


def _own_sequences(tl, mask, rank_sequences, all_sequences, all_tokens, world_size):
    return ((tl * mask).sum(1) / mask.sum(1)).sum() / rank_sequences


def _no_world(tl, mask, rank_sequences, all_sequences, all_tokens, world_size):
    return ((tl * mask).sum(1) / mask.sum(1)).sum() / all_sequences


def _detached(tl, mask, rank_sequences, all_sequences, all_tokens, world_size):
    return SOL.sequence_mean_loss(
        tl, mask, rank_sequences, all_sequences, all_tokens, world_size
    ).detach()


@pytest.mark.parametrize(
    ("wrong", "case", "words"),
    [
        (_per_token, "1 rank", ["per-token objective", "off by"]),
        (_own_sequences, "2 ranks with very different token counts", ["OWN sequences"]),
        (_no_world, "2 ranks with very different token counts", ["1/2", "AVERAGES"]),
        (_detached, "1 rank", ["no gradient"]),
    ],
)
def test_sequence_mean_mistakes_are_named(wrong, case, words):
    assert_failed(check_sequence_mean_loss(wrong), case, *words)


# ---------------------------------------------------------------- exercise 2 (on the ranks)
@pytest.mark.ranks
def test_trainer_solution_passes_and_stub_is_todo(cluster):
    verdict = check_trainer(SOL.Trainer, cluster).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total == 4
    assert_todo(check_trainer(todo, cluster))


@pytest.mark.ranks
def test_the_given_trainer_is_right_once_then_drifts(cluster):
    verdict = check_trainer(CachedCountTrainer, cluster)
    assert_failed(
        verdict, "after step 2 of 4", "drift from the reference", "still comes from step 1"
    )
    assert verdict.cases_passed == 1
    drift = verdict.message.split("after each step: ")[1].split(";")[0].split(", ")
    assert float(drift[0]) < 1e-5 < float(drift[1])  # measured: right, then not
