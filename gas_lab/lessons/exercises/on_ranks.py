"""Run a learner's function on every rank, for the checkers whose exercises need the ranks.

:func:`run_on_ranks` is the one plumbing those checkers share: it turns an untouched TODO on
any rank into ``NotImplementedError`` here (so :func:`~gas_lab.lessons.exercises.check_cases` reports
"todo"), and an exception on a rank into a :class:`RankFailure` that names the rank.
"""

from __future__ import annotations

from collections.abc import Callable


class RankFailure(RuntimeError):
    """The learner's function raised on a rank; the message names the rank and the error."""


def _on_rank(case: Callable, fn: Callable, args: tuple):
    try:
        return ("ok", case(fn, *args))
    except NotImplementedError:
        return ("todo", None)
    except Exception as exc:  # report the learner's error, don't let the call blow up
        return ("raised", f"{type(exc).__name__}: {exc}")


def run_on_ranks(cluster, case: Callable, fn: Callable, *args, timeout: float = 30.0) -> list:
    """``case(fn, *args)`` on every rank -> ``[result of rank 0, ...]``; NotImplementedError if
    any rank hit the TODO, :class:`RankFailure` if one raised anything else."""
    results = cluster.run(_on_rank, case, fn, args, timeout=timeout)
    if any(kind == "todo" for kind, _ in results):
        raise NotImplementedError
    for rank, (kind, value) in enumerate(results):
        if kind == "raised":
            raise RankFailure(f"on rank {rank}: {value}")
    return [value for _, value in results]


_MEASURED: dict = {}  # (what, key) -> its measurement: the checkers measure deterministic runs


def measured_once(key, measure: Callable[[], object]):
    """``measure()`` the first time ``key`` is asked for in this session, then the same result:
    a prediction is checked against a live run without paying for it again on every check."""
    if key not in _MEASURED:
        _MEASURED[key] = measure()
    return _MEASURED[key]
