"""What every tests/test_lessonNN_exercises.py needs: the lesson's solutions, the untouched TODO
stub, and the checks that a verdict says "todo" or "failed" the way a learner should read it.

Functions here may be shipped to the ranks (``todo`` is): gas_lab.runtime.cluster sends a test-side
module's code by value, since the ranks cannot import tests/.
"""

import importlib.util
from pathlib import Path

import pytest

from gas_lab.lessons.exercises import verdict as verdicts
from gas_lab.lessons.exercises.verdict import ExerciseFailed

ROOT = Path(__file__).resolve().parents[1]


def reset_tries() -> None:
    """Forget every wrong try in this process (each test starts a case from a first try)."""
    verdicts._FAILED_TRIES.clear()
    verdicts._LAST_FAILED.clear()


def load_solutions(lesson: int | str):
    """solutions/lessonNN.py (``lesson`` a number) or solutions/<lesson>.py (an appendix's
    name, e.g. "appendix_a5") as a module."""
    # solutions/ is not a package on purpose (handed out separately): load it by path
    name = f"lesson{lesson:02d}" if isinstance(lesson, int) else lesson
    spec = importlib.util.spec_from_file_location(
        f"{name}_solutions", ROOT / "solutions" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def todo(*args):
    """The exercise cell as the learner finds it."""
    raise NotImplementedError


def assert_todo(verdict):
    """An untouched TODO is reported as "todo" (not raised), and strict mode refuses it."""
    assert verdict.status == "todo", str(verdict)
    assert "NotImplementedError" in verdict.message, verdict.message
    with pytest.raises(ExerciseFailed):
        verdict.raise_if_failed()


def assert_failed(verdict, case, *words):
    """A first wrong answer fails on ``case`` and the message names what differs (every one of
    ``words``); the hint that gives the fix is held back (``verdict.hint()`` has it), and strict
    mode raises."""
    assert verdict.status == "failed", str(verdict)
    assert f"case '{case}'" in verdict.message, verdict.message
    for word in words:
        assert word in verdict.message, verdict.message
    assert verdict.fix and verdict.hint().startswith("Hint:"), verdict.hint()
    assert not any(d.startswith("Hint:") for d in verdict.details), str(verdict)
    assert verdict.fix not in str(verdict), str(verdict)
    with pytest.raises(ExerciseFailed):
        verdict.raise_if_failed()


def first_try(check, *args, **kwargs):
    """``check(*args)`` as a learner's first wrong try (earlier checks in the test forgotten)."""
    reset_tries()
    return check(*args, **kwargs)


def assert_hint_on_second_try(check, *words):
    """The same wrong answer checked twice: the second verdict shows the hint (every one of
    ``words`` in it)."""
    first, second = check(), check()
    assert not any(d.startswith("Hint:") for d in first.details), str(first)
    hints = [d for d in second.details if d.startswith("Hint:")]
    assert hints, str(second)
    for word in words:
        assert word in hints[0], hints[0]


def without_launcher_env(monkeypatch):
    """For the checkers that build world-size-1 engines: no launcher variables may leak in."""
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
