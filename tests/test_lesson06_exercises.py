"""Lesson 06 checkers: solutions pass, untouched stubs are 'todo', plausible mistakes fail."""

import dataclasses

import pytest
from exercise_support import assert_failed, assert_todo, load_solutions, todo

from gas_lab.lessons.exercises.lesson06 import (
    SCENARIOS,
    check_new_rule,
    check_predictions,
    describe,
    new_cases,
    predict_with,
)
from gas_lab.rules import prediction

SOL = load_solutions(6)


def test_scenarios_are_measured_cases_the_key_predicts():
    cases = {c["id"]: c for c in prediction.measured_matrix()["cases"]}
    outcomes = {cases[i]["outcome"] for i in SCENARIOS.values()}
    assert outcomes == {"accepted", "rejected"}
    for case_id in SCENARIOS.values():
        assert "then:" in describe(cases[case_id])


def test_the_solution_rule_changes_only_the_new_cases():
    rule = SOL.zero_pipeline_rule()
    fired = {c["id"]: predict_with(rule, c)[0] for c in new_cases()}
    assert fired["pipeline/stage=2/managed=True"] is rule
    assert fired["pipeline/stage=2/managed=False"].name == "unmanaged_pipeline"  # known first


@pytest.mark.ranks
@pytest.mark.parametrize(
    ("check", "solution"),
    [(check_predictions, SOL.my_predictions), (check_new_rule, SOL.zero_pipeline_rule)],
)
def test_solutions_pass_and_stubs_are_todo(cluster, check, solution):
    verdict = check(solution, cluster).raise_if_failed()
    assert verdict.cases_passed == verdict.cases_total >= 5
    assert_todo(check(todo, cluster))


# ---------------------------------------------------------------- exercise 1
@pytest.mark.ranks
@pytest.mark.parametrize(
    ("letter", "wrong", "words"),
    [
        ("H", "accepted", ["measured now on DeepSpeed", "no_sync()", "no_sync_stage23"]),
        ("E", "loss.backward", ["'loss.backward'", "accepted"]),
        ("F", "accepted", ["at initialize()", "unmanaged_overlap_comm"]),
    ],
)
def test_wrong_predictions_are_explained(cluster, letter, wrong, words):
    answers = {**SOL.my_predictions(), letter: wrong}
    assert_failed(check_predictions(lambda: answers, cluster), f"scenario {letter}", *words)


@pytest.mark.ranks
def test_unknown_answers_are_reported(cluster):
    answers = {**SOL.my_predictions(), "A": "rejected"}
    assert_failed(check_predictions(lambda: answers, cluster), "scenario A", "answer one of")


# ---------------------------------------------------------------- exercise 2
def _changed(**fields):
    return lambda: dataclasses.replace(SOL.zero_pipeline_rule(), **fields)


@pytest.mark.ranks
@pytest.mark.parametrize(
    ("wrong", "case", "words"),
    [
        (
            _changed(applies=lambda s: s.pipeline),
            "every case of the committed matrix",
            ["pipeline/stage=0/managed=True", "DeepSpeed accepts it"],
        ),
        (
            _changed(applies=lambda s: s.pipeline and s.config.zero_optimization.stage == 2),
            "new: pipeline/stage=3/managed=True, measured now",
            ["the rules accept it"],
        ),
        (
            _changed(deepspeed_raises="ValueError"),
            "new: pipeline/stage=2/managed=True, measured now",
            ["AssertionError", "says ValueError"],
        ),
        (
            _changed(deepspeed_message="ZeRO-3 is incompatible"),
            "new: pipeline/stage=2/managed=True, measured now",
            ["message starts"],
        ),
        (
            _changed(action="train_batch", moment="call"),
            "new: pipeline/stage=2/managed=True, measured now",
            ["raises at initialize"],
        ),
    ],
)
def test_rule_mistakes_are_named(cluster, wrong, case, words):
    assert_failed(check_new_rule(wrong, cluster), case, *words)


@pytest.mark.ranks
def test_not_a_rule_is_reported(cluster):
    verdict = check_new_rule(lambda: "stage >= 2", cluster)
    assert verdict.status == "failed" and "TypeError" in verdict.message
