"""Lesson 06 checkers: solutions pass, untouched stubs are 'todo', typical mistakes get what
differs on a first try and their fix on the second."""

import dataclasses
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
)

from gas_lab.lessons.exercises import lesson06
from gas_lab.lessons.exercises.lesson06 import (
    SCENARIOS,
    check_new_rule,
    check_predictions,
    describe,
    new_cases,
    predict_with,
)
from gas_lab.measure import prediction
from gas_lab.rules.operations import call_of

SOL = load_solutions(6)
CASES = {c["id"]: c for c in prediction.measured_matrix()["cases"]}


def test_scenarios_are_measured_cases_the_lesson_did_not_run():
    outcomes = [CASES[case_id]["outcome"] for case_id, _ in SCENARIOS.values()]
    assert sorted(outcomes) == ["accepted"] * 4 + ["rejected"] * 4
    for case_id, why in SCENARIOS.values():
        assert "then:" in describe(CASES[case_id]) and why.strip()
    assert lesson06.scenarios().count("\n") == len(SCENARIOS)  # the base line, then one each
    # none of them is a case the lesson re-measures live (its DEMO list)
    root = Path(__file__).resolve().parents[1]
    text = (root / "tutorials" / "06_rejected_combinations.ipynb").read_text()
    assert not [case_id for case_id, _ in SCENARIOS.values() if case_id in text]


def test_the_solution_predicts_what_the_rules_predict():
    for letter, (case_id, _) in SCENARIOS.items():
        case = CASES[case_id]
        rule, op = prediction.predict(case["config"], case["ops"], case["pipeline"])
        expected = "accepted" if rule is None else call_of(op).call
        assert SOL.my_predictions()[letter] == expected, letter


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
def _answers(letter, wrong):
    return lambda: {**SOL.my_predictions(), letter: wrong}


@pytest.mark.ranks
@pytest.mark.parametrize(
    ("letter", "wrong", "words", "fix"),
    [
        # a refusal predicted for an accepted case: the rule's condition read too broadly
        ("E", "loss.backward", ["'loss.backward'", "accepts it"], "stage 0 only"),
        ("D", "set_gradient_accumulation_boundary", ["accepts it"], "about unmanaged mode"),
        # accepted predicted for a refusal: which call is left to find
        ("H", "accepted", ["'accepted'", "refuses it"], "no_sync_stage23"),
        ("A", "accepted", ["refuses it"], "offload"),
        # the right refusal, the wrong call
        ("G", "step", ["refuses it, but not at step()"], "on entering the block"),
    ],
)
def test_wrong_predictions_say_what_differs_then_why(cluster, letter, wrong, words, fix):
    verdict = first_try(check_predictions, _answers(letter, wrong), cluster)
    assert_failed(verdict, f"scenario {letter}", *words)
    assert "section 3" in str(verdict)  # where to look again
    truth = SOL.my_predictions()[letter]
    if truth != "accepted" and wrong == "accepted":  # the call that raises is not given away
        assert truth not in verdict.message
    reset_tries()
    assert_hint_on_second_try(lambda: check_predictions(_answers(letter, wrong), cluster), fix)


@pytest.mark.ranks
def test_unknown_answers_are_reported(cluster):
    verdict = first_try(check_predictions, _answers("A", "rejected"), cluster)
    assert_failed(verdict, "scenario A", "answer one of")


# ---------------------------------------------------------------- exercise 2
def _changed(**fields):
    return lambda: dataclasses.replace(SOL.zero_pipeline_rule(), **fields)


@pytest.mark.ranks
@pytest.mark.parametrize(
    ("wrong", "case", "words", "fix"),
    [
        (
            _changed(applies=lambda s: s.pipeline),
            "every case of the committed matrix",
            ["pipeline/stage=0/managed=True", "DeepSpeed accepts it"],
            "holds for too much",
        ),
        (
            _changed(applies=lambda s: s.pipeline and s.config.zero_optimization.stage == 2),
            "new: pipeline/stage=3/managed=True, measured now",
            ["your rules accept it"],
            "holds for too little",
        ),
        (
            _changed(deepspeed_raises="ValueError"),
            "new: pipeline/stage=2/managed=True, measured now",
            ["AssertionError", "says ValueError"],
            "type name",
        ),
        (
            _changed(deepspeed_message="ZeRO-3 is incompatible"),
            "new: pipeline/stage=2/managed=True, measured now",
            ["does not start with", "'ZeRO-3 is incompatible'"],
            "first words of the message",
        ),
        (
            _changed(action="train_batch", moment="call"),
            "new: pipeline/stage=2/managed=True, measured now",
            ["raises at initialize"],
            "inside deepspeed.initialize",
        ),
    ],
)
def test_rule_mistakes_say_what_differs_then_why(cluster, wrong, case, words, fix):
    assert_failed(first_try(check_new_rule, wrong, cluster), case, *words)
    reset_tries()
    assert_hint_on_second_try(lambda: check_new_rule(wrong, cluster), fix)


@pytest.mark.ranks
def test_not_a_rule_is_reported(cluster):
    verdict = first_try(check_new_rule, lambda: "stage >= 2", cluster)
    assert verdict.status == "failed" and "TypeError" in verdict.message
