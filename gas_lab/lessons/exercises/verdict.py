"""The one verdict type every checker returns, and the loop that produces it.

A wrong answer is taught in two tries. The first verdict says **what differs** (the case, what
was expected, what came back) and **where to look** in the lesson, and nothing more: finding the
fix is the exercise. Only a later wrong try on the same case, or ``verdict.hint()``, shows the
hint that gives the fix. A judge says both parts with :class:`Miss`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


class ExerciseFailed(AssertionError):
    """Raised by :meth:`Verdict.raise_if_failed`; its message is the friendly verdict."""


@dataclass(frozen=True)
class Miss:
    """A judge's account of a wrong result: ``differs`` is shown at once (expected, got, never
    the fix); ``fix``, the case's own hint, only from the second wrong try on."""

    differs: str
    fix: str | None = None


# Wrong tries per (exercise, case) in this kernel: the second one on a case earns its hint.
_FAILED_TRIES: dict[tuple[str, str], int] = {}


_LAST_FAILED: list[Verdict] = []  # the latest failed verdict, for hint()


def hint() -> str:
    """The hint for the latest failed check (each lesson's checker module re-exports this:
    ``lesson03.hint()``)."""
    return _LAST_FAILED[-1].hint() if _LAST_FAILED else "No check has failed yet."


@dataclass
class Verdict:
    """The outcome of one exercise check.

    ``status`` is ``"passed"``, ``"failed"`` or ``"todo"`` (the function still raises
    ``NotImplementedError``). ``message`` is what the learner reads; ``details`` the lines
    under it (where to look; from the second wrong try, the hint).
    """

    exercise: str
    status: str
    message: str
    cases_passed: int = 0
    cases_total: int = 0
    details: list[str] = field(default_factory=list)
    fix: str | None = field(default=None, repr=False)  # the hint, held back on a first try

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def hint(self) -> str:
        """Ask for the hint that gives the fix (a first wrong try does not show it)."""
        return f"Hint: {self.fix}" if self.fix else "No hint: the exercise is not failing."

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
    cases: Iterable[tuple[str, Callable[[], object], Callable[[object], str | Miss | None]]],
    hint: str,
    where: str | None = None,
    module: str | None = None,
) -> Verdict:
    """Run ``(name, run, judge)`` cases in order and stop at the first failure.

    ``run()`` calls the learner's code; ``judge(result)`` returns ``None`` when the result is
    right, else what differs: a sentence, or a :class:`Miss` with the case's own fix. ``where``
    names the part of the lesson to look at again (shown on every wrong try); ``hint`` is the
    exercise's general fix, used when a case has none of its own (held back on a first try).
    ``module``: the ``__name__`` of the checker module the notebook imports, whose ``hint()``
    a wrong try names (by default the module each case's ``run`` is defined in).
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
            return _failed(
                exercise,
                name,
                f"raised {type(exc).__name__}: {exc}",
                i,
                len(cases),
                where,
                hint,
                _module_of(run, module),
            )
        problem = judge(result)
        if problem is not None:
            miss = problem if isinstance(problem, Miss) else Miss(problem)
            return _failed(
                exercise,
                name,
                miss.differs,
                i,
                len(cases),
                where,
                miss.fix or hint,
                _module_of(run, module),
            )
    for key in [k for k in _FAILED_TRIES if k[0] == exercise]:
        del _FAILED_TRIES[key]
    return Verdict(
        exercise, "passed", f"all {len(cases)} cases match the reference.", len(cases), len(cases)
    )


def _module_of(fn, module: str | None = None) -> str:
    """``lesson03`` for a case defined in gas_lab.lessons.exercises.lesson03 (the name the
    notebook imports, so the learner can call ``lesson03.hint()``)."""
    module = module or getattr(fn, "__module__", "")
    return module.rpartition(".")[2] or "the checker module"


def _failed(exercise, case, differs, passed, total, where, fix, module) -> Verdict:
    tries = _FAILED_TRIES[exercise, case] = _FAILED_TRIES.get((exercise, case), 0) + 1
    sep = " " if differs.startswith("raised ") else ": "
    message = f"case '{case}'{sep}{differs}"
    details = [f"Look again at: {where}"] if where else []
    if tries > 1:
        details.append(f"Hint: {fix}")
    else:
        details.append(f"Stuck? A second wrong try shows a hint; to see it now: `{module}.hint()`.")
    verdict = Verdict(exercise, "failed", message, passed, total, details, fix)
    _LAST_FAILED[:] = [verdict]
    return verdict


def answer_for(fn: Callable[[], object], key: str, example: str):
    """The learner's answer for ``key`` from ``fn()``, which returns a dict of answers (as in
    ``{example}``). Called first in a case, so an untouched TODO is reported before the
    checker measures anything."""
    answers = fn()
    if not isinstance(answers, dict):
        raise TypeError(f"return a dict like {example}, got {type(answers).__name__}")
    return answers.get(key)


def check_predictions(
    exercise: str,
    fn: Callable[[], object],
    keys: Iterable[str],
    measure: Callable[[str], object],
    judge: Callable[[str, object, object], str | Miss | None],
    *,
    case: str,
    example: str,
    hint: str,
    where: str,
    module: str,
) -> Verdict:
    """Predict, then measure: ``fn()`` returns a dict of answers (as in ``example``), one for
    each of ``keys``. Each key is the case ``f"{case} {key}"``: its answer is asked for first
    (:func:`answer_for`), then ``measure(key)`` runs, and ``judge(key, answer, measured)`` says
    what differs, as a judge of :func:`check_cases` does (``hint``, ``where`` and ``module``:
    as there)."""

    def one(key: str):
        def run():
            return answer_for(fn, key, example), measure(key)

        return (f"{case} {key}", run, lambda result: judge(key, *result))

    return check_cases(exercise, [one(key) for key in keys], hint, where=where, module=module)
