"""Lesson 06 checkers: solutions pass, untouched stubs are 'todo', plausible mistakes fail."""

import pytest
from exercise_support import assert_failed, assert_todo, load_solutions, todo

from gas_lab.lessons.exercises.lesson06 import (
    SCENARIOS,
    check_predictions,
    check_refusal_rules,
    expected,
    initialize_cases,
)
from gas_lab.rules import prediction

SOL = load_solutions(6)
CHECKS = [
    (check_predictions, SOL.my_predictions),
    (check_refusal_rules, SOL.refused_at_initialize),
]


@pytest.mark.parametrize(("check", "solution"), CHECKS)
def test_solution_passes(check, solution):
    verdict = check(solution).raise_if_failed()
    assert verdict.status == "passed" and verdict.cases_passed == verdict.cases_total >= 8


@pytest.mark.parametrize(("check", "_solution"), CHECKS)
def test_untouched_stub_is_todo(check, _solution):
    assert_todo(check(todo))


# ---------------------------------------------------------------- exercise 1
def test_the_key_covers_every_answer_and_comes_from_the_data():
    answers = {letter: expected(s)[0] for letter, s in SCENARIOS.items()}
    assert set(answers.values()) == {"accepted", "rejected", "silently wrong"}
    # A rejection in the key is a rule that the measured matrix confirms (tests/test_rules.py).
    for letter, s in SCENARIOS.items():
        if answers[letter] == "rejected":
            assert prediction.predict(s.config, s.ops)[0] is not None


def test_believing_the_overlap_message_fails_on_stage_3():
    def believes_message():
        return {**SOL.my_predictions(), "B": "rejected"}

    assert_failed(
        check_predictions(believes_message), "scenario B", "you said 'rejected'", "'accepted'"
    )


def test_n_not_gas_answered_accepted_is_named():
    def misses_scaling():
        return {**SOL.my_predictions(), "C": "accepted"}

    assert_failed(check_predictions(misses_scaling), "scenario C", "N/GAS", "scale_wrt_gas=False")


def test_missing_answer_and_bad_word_are_reported():
    partial = {k: v for k, v in SOL.my_predictions().items() if k != "E"}
    assert_failed(check_predictions(lambda: partial), "scenario E", "got None")
    verdict = check_predictions(lambda: {**SOL.my_predictions(), "A": "refused"})
    assert_failed(verdict, "scenario A", "'refused'")
    assert check_predictions(lambda: ["rejected"]).message.count("TypeError") == 1


# ---------------------------------------------------------------- exercise 2
def test_refusal_cases_are_the_measured_ones():
    cases = initialize_cases()
    assert len(cases) >= 20
    assert {c["outcome"] for c in cases} == {"accepted", "rejected"}


def test_overlap_rule_copied_from_the_message_fails_on_stage_3():
    def from_message(config):  # "overlap_comm only with ZeRO stage 2"
        zero = config.get("zero_optimization", {})
        if config.get("managed_gradient_accumulation", True) is False and zero.get("overlap_comm"):
            return zero.get("stage", 0) != 2
        return SOL.refused_at_initialize(config)

    assert_failed(
        check_refusal_rules(from_message),
        "grid/stage=3/managed=False/overlap_comm=True/offload=none/precision=fp32",
        "DeepSpeed accepts it (measured)",
    )


def test_forgetting_amp_when_disabled_fails():
    def amp_only_if_enabled(config):
        if "amp" in config:
            return config["amp"].get("enabled", False)
        return SOL.refused_at_initialize(config)

    assert_failed(
        check_refusal_rules(amp_only_if_enabled),
        "amp/managed=True/enabled=False",
        "refuses it (measured: DeepSpeedConfigError",
    )


def test_non_bool_answer_is_reported():
    verdict = check_refusal_rules(lambda config: "no")
    assert verdict.status == "failed" and "return True or False" in verdict.message
