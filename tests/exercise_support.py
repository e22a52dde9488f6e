"""What every tests/test_lessonNN_exercises.py needs: the lesson's solutions, the untouched TODO
stub, and the checks that a verdict says "todo" or "failed" the way a learner should read it.

Functions here may be shipped to the ranks (``todo`` is): gas_lab.runtime.cluster sends a test-side
module's code by value, since the ranks cannot import tests/.
"""

import importlib.util
from pathlib import Path

import pytest

from gas_lab.lessons.exercises.verdict import ExerciseFailed

ROOT = Path(__file__).resolve().parents[1]


def load_solutions(lesson: int):
    """solutions/lessonNN.py as a module."""
    # solutions/ is not a package on purpose (handed out separately): load it by path
    name = f"lesson{lesson:02d}"
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
    """A wrong answer fails on ``case``, the message names the mistake (every one of ``words``),
    a hint follows, and strict mode raises."""
    assert verdict.status == "failed", str(verdict)
    assert f"case '{case}'" in verdict.message, verdict.message
    for word in words:
        assert word in verdict.message, verdict.message
    assert verdict.details and verdict.details[0].startswith("Hint:")
    with pytest.raises(ExerciseFailed):
        verdict.raise_if_failed()


def without_launcher_env(monkeypatch):
    """For the checkers that build world-size-1 engines: no launcher variables may leak in."""
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
