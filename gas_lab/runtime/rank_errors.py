"""How a failed or stalled rank reaches the notebook: the two errors ``cluster.run`` raises.

Both say which ranks, and a :class:`RankError` carries each failed rank's own traceback, so a
learner reads what went wrong where it went wrong, not a wall of runtime internals.
"""

from __future__ import annotations

import re


class RankError(RuntimeError):
    """A function or cell raised on one or more ranks. ``.errors`` maps rank -> traceback text."""

    def __init__(self, errors: dict[int, str], stalled: list[int], restarted: bool):
        self.errors, self.stalled = errors, stalled
        first = min(errors)
        lines = [f"rank {first} raised {errors[first].strip().splitlines()[-1]}"]
        if len(errors) > 1:
            lines.append(f"(ranks {sorted(errors)} all raised; rank {first}'s traceback below)")
        if stalled:
            lines.append(
                f"ranks {stalled} were still waiting (most likely in a collective that rank "
                f"{first} never reached)" + ("; the ranks were restarted." if restarted else ".")
            )
        lines += ["", f"--- traceback on rank {first} ---", errors[first].rstrip()]
        super().__init__("\n".join(lines))


class RankStallError(TimeoutError):
    """Some ranks did not finish within the timeout. ``.stalled`` lists them."""

    def __init__(self, stalled: list[int], finished: list[int], timeout: float):
        self.stalled, self.finished = stalled, finished
        super().__init__(
            f"ranks {stalled} stalled: no result after {timeout:g} s "
            f"(ranks {finished} finished). A rank usually stalls waiting in a collective "
            "(all_reduce, barrier, ...) that another rank never joined. The ranks were "
            "restarted; variables on the ranks are lost."
        )


def error_text(future) -> str:
    exc = future.exception()
    if exc is None:
        return future.get()[1]
    # The rank itself died or ipyparallel failed: keep what it says, without colour codes.
    tb = getattr(exc, "traceback", None) or f"{type(exc).__name__}: {exc}"
    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(tb) if isinstance(tb, list) else str(tb))
