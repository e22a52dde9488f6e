"""How a failed, stalled or interrupted call on the ranks reaches the notebook.

Each error says which ranks and what happened to them, cause first: a rank that died comes
before the ranks that failed because their partner was gone, and a rank that is busy (importing,
building, computing) is never reported as stuck in a collective. A :class:`RankError` carries
each failed rank's own traceback, so a learner reads what went wrong where it went wrong, not a
wall of runtime internals.
"""

from __future__ import annotations

import re
import signal

RESTARTED = "The ranks were restarted; variables on the ranks are lost."


def exit_text(code) -> str:
    """``-11`` -> ``killed by signal SIGSEGV``; ``3`` -> ``exit code 3``."""
    if code is None:
        return "exit status unknown"
    code = int(code)
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rs}"


class RankError(RuntimeError):
    """A function or cell failed on one or more ranks: raised, died, or returned something that
    cannot be sent back. ``.errors`` maps rank -> traceback text, ``.died`` rank -> how it
    ended, ``.stalled`` lists ranks that were still waiting."""

    def __init__(
        self,
        errors: dict[int, str],
        stalled: list[int],
        restarted: bool,
        died: dict[int, str] | None = None,
        unsendable: dict[int, str] | None = None,
        crash: dict[int, str] | None = None,
        what: str = "the call",
        fresh: bool = False,
    ):
        self.errors, self.stalled = errors, stalled
        self.died, self.unsendable = died or {}, unsendable or {}
        lines = [f"rank {r} died ({how}) while running {what}." for r, how in self.died.items()]
        for r, msg in self.unsendable.items():
            lines.append(f"rank {r}: {msg}")
        cause = min(self.died or errors or self.unsendable)
        if errors:
            first = min(errors)
            why = f" (most likely because {_ranks(sorted(self.died))} died)" if self.died else ""
            lines.append(f"rank {first} raised {errors[first].strip().splitlines()[-1]}{why}")
            if len(errors) > 1:
                lines.append(f"(ranks {sorted(errors)} all raised; rank {first}'s traceback below)")
        if stalled:
            lines.append(
                f"ranks {stalled} were still waiting (most likely in a collective that rank "
                f"{cause} never reached)."
            )
        if restarted:
            lines.append(RESTARTED)
        if fresh:
            lines.append(
                "Note: the ranks had been started anew for this call, so variables defined on "
                "them by earlier cells are gone: re-run those cells first."
            )
        for r, text in (crash or {}).items():
            lines += ["", f"--- where rank {r} crashed ---", text.rstrip()]
        if errors:
            lines += ["", f"--- traceback on rank {first} ---", errors[first].rstrip()]
        super().__init__("\n".join(lines))


class RankStallError(TimeoutError):
    """Some ranks did not finish within the timeout. ``.stalled`` lists them, ``.states`` says
    what each was doing (waiting in a collective, or busy), ``.restarted`` whether the ranks
    were restarted (their variables are then gone; None: stopped, at start-up)."""

    def __init__(
        self,
        stalled: list[int],
        finished: list[int],
        timeout: float,
        states: dict | None = None,
        restarted: bool | None = True,
    ):
        self.stalled, self.finished, self.timeout = stalled, finished, timeout
        self.states, self.restarted = states or {}, restarted
        doing = "; ".join(f"rank {r}: {s.text}" for r, s in self.states.items())
        busy = [r for r, s in self.states.items() if s.kind not in ("collective", "unknown")]
        done = f"(ranks {finished} finished)" if finished else "(no rank finished)"
        if not busy:
            lines = [
                f"ranks {stalled} stalled: no result after {timeout:g} s {done}.",
                (doing + ". " if doing else "")
                + "A rank usually stalls waiting in a collective (all_reduce, barrier, ...) that "
                "another rank never joined.",
            ]
        else:
            lines = [
                f"ranks {stalled} did not finish within {timeout:g} s {done}, but "
                f"{_ranks(busy)} {'was' if len(busy) == 1 else 'were'} busy, not stalled in a "
                f"collective: {doing}.",
                "Give long work more time: cluster.run(fn, timeout=600) or %%ranks --timeout 600.",
            ]
        kept = "The work was stopped; the ranks keep their variables."
        lines.append({True: RESTARTED, False: kept, None: "The ranks were stopped."}[restarted])
        super().__init__(" ".join(lines))


class RankInterrupt(KeyboardInterrupt):
    """Kernel -> Interrupt during a call on the ranks. ``.restarted`` says whether the work could
    be stopped on the ranks (False: they keep their variables) or the ranks had to be restarted;
    ``.seconds`` how long stopping took."""

    def __init__(self, message: str, restarted: bool, seconds: float):
        self.restarted, self.seconds = restarted, seconds
        super().__init__(message)


def error_text(future) -> str:
    exc = future.exception()
    if exc is None:
        return future.get()[1]
    # ipyparallel failed (the rank died, ...): keep what it says, without colour codes.
    tb = getattr(exc, "traceback", None) or f"{type(exc).__name__}: {exc}"
    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(tb) if isinstance(tb, list) else str(tb))
