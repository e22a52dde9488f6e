"""Checkers for the exercises at the end of each lesson.

A checker runs the learner's function on small cases against a reference and returns a
:class:`Verdict`: which case, what was expected, what came back, and a hint that names the
concept. In a notebook the verdict is *shown*, not raised, so an untouched TODO cell keeps
the notebook runnable (nbmake stays green); tests call ``verdict.raise_if_failed()``.
"""

from gas_lab.lessons.exercises.verdict import Verdict, check_cases

__all__ = ["Verdict", "check_cases"]
