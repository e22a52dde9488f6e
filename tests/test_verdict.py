"""The two-try protocol of every exercise checker: what differs first, the fix later."""

from gas_lab.lessons.exercises.verdict import Miss, check_cases, check_predictions, hint


def _cases(answer):
    def judge(got):
        if got == 4:
            return None
        return Miss(f"expected 4, got {got}", fix="add two and two")

    return [("two plus two", lambda: answer, judge)]


def _check(answer):
    return check_cases("add", _cases(answer), "the general fix", where="section 1 (*Adding*)")


def test_a_first_wrong_try_says_what_differs_and_where_but_not_the_fix():
    verdict = _check(5)
    assert verdict.status == "failed"
    assert verdict.message == "case 'two plus two': expected 4, got 5"
    assert "section 1 (*Adding*)" in str(verdict)
    assert "add two and two" not in str(verdict)
    assert hint() == verdict.hint() == "Hint: add two and two"


def test_a_second_wrong_try_on_the_case_shows_its_fix():
    _check(5)
    assert "Hint: add two and two" in str(_check(3))


def test_a_pass_forgets_the_tries():
    _check(5)
    assert _check(4).passed
    assert "Hint:" not in str(_check(5))


def test_a_crash_gets_the_general_fix_later():
    def crash():
        raise ValueError("boom")

    first = check_cases("add", [("c", crash, lambda r: None)], "the general fix", where="here")
    assert first.message == "case 'c' raised ValueError: boom"
    assert "the general fix" not in str(first)
    second = check_cases("add", [("c", crash, lambda r: None)], "the general fix", where="here")
    assert "Hint: the general fix" in str(second)


def _predict(answers, measured):
    return check_predictions(
        "predict",
        lambda: answers,
        ["A", "B"],
        lambda key: measured.append(key) or 4,
        lambda key, got, want: None if got == want else f"{key}: you said {got}",
        case="sum",
        example="{'A': 4, ...}",
        hint="the general fix",
        where="section 2",
        module="gas_lab.lessons.exercises.lesson42",
    )


def test_predictions_ask_for_the_answer_before_measuring_and_name_the_lessons_hint():
    measured = []
    assert _predict({"A": 4, "B": 4}, measured).passed and measured == ["A", "B"]
    measured.clear()
    wrong = _predict({"A": 4, "B": 5}, measured)
    assert wrong.message == "case 'sum B': B: you said 5" and measured == ["A", "B"]
    assert "`lesson42.hint()`" in str(wrong)
    measured.clear()
    assert "TypeError" in _predict([4, 4], measured).message and measured == []
