"""The one verdict type every checker returns, and the loop that produces it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


class ExerciseFailed(AssertionError):
    """Raised by :meth:`Verdict.raise_if_failed`; its message is the friendly verdict."""


@dataclass
class Verdict:
    """The outcome of one exercise check.

    ``status`` is ``"passed"``, ``"failed"`` or ``"todo"`` (the function still raises
    ``NotImplementedError``). ``message`` is what the learner reads.
    """

    exercise: str
    status: str
    message: str
    cases_passed: int = 0
    cases_total: int = 0
    details: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def __str__(self) -> str:
        icon = {"passed": "PASS", "failed": "NOT YET", "todo": "TODO"}[self.status]
        head = f"[{icon}] {self.exercise}: {self.message}"
        return "\n".join([head, *("    " + d for d in self.details)])

    def _repr_markdown_(self) -> str:
        # Rendered in Jupyter: a coloured one-liner plus the details as a list.
        colour = {"passed": "green", "failed": "crimson", "todo": "darkorange"}[self.status]
        lines = [f"<b style='color:{colour}'>{str(self).splitlines()[0]}</b>"]
        lines += [f"- {d}" for d in self.details]
        return "\n\n".join(lines)

    def __repr__(self) -> str:
        return str(self)

    def raise_if_failed(self) -> Verdict:
        """For tests and strict mode: raise unless the exercise passed."""
        if not self.passed:
            raise ExerciseFailed(str(self))
        return self


def check_cases(
    exercise: str,
    cases: Iterable[tuple[str, Callable[[], object], Callable[[object], str | None]]],
    hint: str,
) -> Verdict:
    """Run ``(name, run, judge)`` cases in order and stop at the first failure.

    ``run()`` calls the learner's code; ``judge(result)`` returns ``None`` when the result is
    right, or a sentence saying what was expected and what came back.
    """
    cases = list(cases)
    for i, (name, run, judge) in enumerate(cases):
        try:
            result = run()
        except NotImplementedError:
            return Verdict(
                exercise,
                "todo",
                "not attempted yet: replace the `raise NotImplementedError` with your code.",
                i,
                len(cases),
            )
        except Exception as exc:  # the learner's code crashed: say where and how
            return Verdict(
                exercise,
                "failed",
                f"case '{name}' raised {type(exc).__name__}: {exc}",
                i,
                len(cases),
                [f"Hint: {hint}"],
            )
        problem = judge(result)
        if problem is not None:
            return Verdict(
                exercise, "failed", f"case '{name}': {problem}", i, len(cases), [f"Hint: {hint}"]
            )
    return Verdict(
        exercise, "passed", f"all {len(cases)} cases match the reference.", len(cases), len(cases)
    )


def answer_for(fn: Callable[[], object], key: str, example: str):
    """The learner's answer for ``key`` from ``fn()``, which returns a dict of answers (as in
    ``{example}``). Called first in a case, so an untouched TODO is reported before the
    checker measures anything."""
    answers = fn()
    if not isinstance(answers, dict):
        raise TypeError(f"return a dict like {example}, got {type(answers).__name__}")
    return answers.get(key)
