"""Appendix A5's checker (one process): the solution passes, the untouched stub is 'todo',
typical mistakes fail with what differs, and the fix comes on the second try."""

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

from gas_lab.lessons.exercises.appendix_a5 import check_ranks_needed

SOL = load_solutions("appendix_a5")


def test_ranks_needed_solution_passes_and_stub_is_todo():
    verdict = check_ranks_needed(SOL.ranks_needed).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total >= 5
    assert_todo(check_ranks_needed(todo))


def _all_sharded(params, stage, budget):  # ZeRO-1 divides everything by W: it does not
    w = 1
    while 16 * params / (w if stage >= 1 else 1) > budget:
        if stage == 0:
            return None
        w += 1
    return w


def _fp32(params, stage, budget):  # 4 + 4 + 4 + 8 bytes per parameter
    sizes = {"weights": (4, 3), "gradients": (4, 2), "master": (4, 1), "moments": (8, 1)}
    for w in range(1, 10**4):
        if sum(n * params / (w if stage >= s else 1) for n, s in sizes.values()) <= budget:
            return w
    return None


def _search_forever(params, stage, budget):  # no floor: never ends where no W fits
    w = 1
    while (2 + 2 + 12 / (w if stage >= 1 else 1)) * params > budget:
        w += 1
    return w


def _one_too_many(params, stage, budget):
    w = SOL.ranks_needed(params, stage, budget)
    return None if w is None else w + 1


@pytest.mark.parametrize(
    "fn, case, differs, fix",
    [
        (_all_sharded, "7B parameters, stage 1, 40 GB", "over the 40 GB budget", "only the fp32"),
        (_fp32, "7B parameters, stage 1, 40 GB", "no number of ranks fits", "2 + 2 + 12"),
        (_search_forever, "7B parameters, stage 2, 20 GB", "no answer within", "floor"),
        (_one_too_many, "7B parameters, stage 3, 80 GB", "fewer ranks fit too", "SMALLEST"),
    ],
)
def test_ranks_needed_mistakes_are_named(fn, case, differs, fix):
    verdict = first_try(check_ranks_needed, fn)
    assert_failed(verdict, case, differs)
    reset_tries()
    assert_hint_on_second_try(lambda: check_ranks_needed(fn), fix)
