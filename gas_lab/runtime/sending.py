"""What travels to the ranks with a function: its module, by value, when the ranks cannot import
it, and its source, so that a traceback on a rank shows the learner's own lines."""

from __future__ import annotations

import inspect
import os
import sys


def source_of(fn) -> tuple[list[str], int] | None:
    try:
        lines, first = inspect.getsourcelines(fn)
        return lines, max(first, 1)
    except (OSError, TypeError):
        return None


def ship_module_by_value(fn) -> None:
    """Functions from a test file or a script beside the notebook are not importable on the
    ranks, so send their module's code along instead of a reference to it."""
    import sysconfig

    import cloudpickle

    if not callable(fn):
        return
    mod = sys.modules.get(getattr(fn, "__module__", None) or "")
    path = getattr(mod, "__file__", None)
    if mod is None or path is None or mod.__name__ == "__main__":
        return
    roots = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib")}
    roots.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # gas_lab/ itself
    if not any(os.path.abspath(path).startswith(r) for r in roots):
        cloudpickle.register_pickle_by_value(mod)
