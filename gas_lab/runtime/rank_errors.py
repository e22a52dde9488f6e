"""How a failed, stalled or interrupted call on the ranks reaches the notebook.

Each error says which ranks and what happened to them, cause first: a rank that died comes
before the ranks that failed because their partner was gone, and a rank that is busy (importing,
building, computing) is never reported as stuck in a collective.

In a notebook, IPython shows an error through its ``_render_traceback_`` when it has one: these
errors show the failing rank's own traceback first (the learner's frames, as Python prints
them, where the rank raised, was interrupted, or waits), then one line of what the runtime did.
``str(error)`` keeps the full report (every rank, crash reports); the notebook keeps the last
error as ``cluster.last_error``, so ``print(cluster.last_error)`` shows it, and
``traceback.print_exception(cluster.last_error)`` adds the runtime's own frames.
"""

from __future__ import annotations

import linecache
import re
import signal

from gas_lab.runtime.rank_state import is_user_code

RESTARTED = "The ranks were restarted; variables on the ranks are lost."
FULL_REPORT = "Full report: print(cluster.last_error)."
_FILE = re.compile(r'^  File "(.+)", line (\d+)(.*)$')


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


def _place(path: str, fn: str) -> tuple[str | None, str]:
    """How IPython names the cell ``path`` is (``Cell In[7]``, or None), and the file that holds
    its lines. A function the notebook sent arrives as ``<dynamic-code>`` (cloudpickle's name for
    code it carries): it is found by name among the notebook's functions."""
    if path.startswith("<%%ranks In["):
        return "Cell " + path[len("<%%ranks ") : -1], path
    try:
        from IPython import get_ipython

        ip = get_ipython()
        if path == "<dynamic-code>":
            path = ip.user_ns[fn].__code__.co_filename
        named = ip.compile.format_code_name(path)
    except (AttributeError, ImportError, KeyError):
        return None, path
    return (" ".join(named) if named else None), path


def rank_traceback(text: str, rank: int) -> list[str]:
    """A rank's traceback as Python printed it, saying which rank, with notebook cells named as
    IPython names them (``Cell In[7], line 5``) instead of the kernel's temporary files."""
    lines = []
    for line in text.rstrip().splitlines():
        if line == "Traceback (most recent call last):":
            line = f"Traceback on rank {rank} (most recent call last):"
        elif m := _FILE.match(line):
            cell, _ = _place(m[1], m[3].removeprefix(", in "))
            line = f"  {cell}, line {m[2]}{m[3]}" if cell else line
        lines.append(line)
    return lines


def stack_lines(rank: int, frames, what: str) -> list[str]:
    """Where a rank that did not answer is, traceback-style: the learner's frames of its sampled
    stack (``frames`` innermost first) with their lines, then what it is doing there."""
    lines = [f"Stack on rank {rank} (most recent call last):"]
    for path, line, fn in reversed(frames):
        if is_user_code(path):
            cell, path = _place(path, fn)
            lines.append(
                f"  {cell}, line {line}, in {fn}"
                if cell
                else f'  File "{path}", line {line}, in {fn}'
            )
            if source := linecache.getline(path, line).strip():
                lines.append(f"    {source}")
    return [*lines, f"rank {rank} is {what}"]


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
        started_anew: bool = False,
        ranks: list[int] | None = None,
    ):
        self.errors, self.stalled, self.restarted = errors, stalled, restarted
        self.died, self.unsendable = died or {}, unsendable or {}
        self.crash, self.what, self.started_anew = crash or {}, what, started_anew
        self.ranks = ranks or sorted({*errors, *stalled, *self.died, *self.unsendable})
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
        if started_anew:
            lines.append(
                "Note: the ranks had been started anew for this call, so variables defined on "
                "them by earlier cells are gone: re-run those cells first."
            )
        for r, text in self.crash.items():
            lines += ["", f"--- where rank {r} crashed ---", text.rstrip()]
        if errors:
            lines += ["", f"--- traceback on rank {first} ---", errors[first].rstrip()]
        super().__init__("\n".join(lines))

    def _render_traceback_(self) -> list[str]:
        """What IPython shows: the first failing rank's own report, then what the runtime did."""
        if self.died:
            r = min(self.died)
            own = [f"rank {r} died ({self.died[r]}) while running {self.what}."]
            own += rank_traceback(self.crash.get(r, ""), r)
        elif self.errors:
            r = min(self.errors)
            own = rank_traceback(self.errors[r], r)
        else:
            r = min(self.unsendable)
            own = [f"rank {r}: {self.unsendable[r]}"]
        failed = sorted({*self.died, *self.errors, *self.unsendable})
        others = [q for q in failed if q != r]
        did = f"gas_lab: {_ranks(failed)} failed" if others else f"gas_lab: rank {r} failed"
        if self.stalled:
            did += f"; {_ranks(self.stalled)} waited for {'them' if others else 'it'}"
        finished = [q for q in self.ranks if q not in failed and q not in self.stalled]
        if finished:
            did += f"; {_ranks(finished)} finished"
        if self.restarted:
            did += "; the ranks were restarted, variables on the ranks are lost"
        else:
            did += "; the ranks keep their variables"
        if self.started_anew:
            did += " (the ranks were new for this call: re-run the cells that define them)"
        return [*own, "", f"{did}. {FULL_REPORT}"]


class RankStallError(TimeoutError):
    """Some ranks did not finish within the timeout. ``.stalled`` lists them, ``.states`` says
    what each was doing (waiting in a collective, or busy), ``.restarted`` whether the ranks
    were restarted (their variables are then gone; None: stopped, at start-up);
    ``.tracebacks`` where a busy rank was stopped."""

    def __init__(
        self,
        stalled: list[int],
        finished: list[int],
        timeout: float,
        states: dict | None = None,
        restarted: bool | None = True,
        tracebacks: dict[int, str] | None = None,
    ):
        self.stalled, self.finished, self.timeout = stalled, finished, timeout
        self.states, self.restarted = states or {}, restarted
        self.tracebacks = tracebacks or {}
        doing = "; ".join(f"rank {r}: {s.text}" for r, s in self.states.items())
        self.busy = [r for r, s in self.states.items() if s.kind not in ("collective", "unknown")]
        done = f"(ranks {finished} finished)" if finished else "(no rank finished)"
        if not self.busy:
            lines = [
                f"ranks {stalled} stalled: no result after {timeout:g} s {done}.",
                (doing + ". " if doing else "")
                + "A rank usually stalls waiting in a collective (all_reduce, barrier, ...) that "
                "another rank never joined.",
            ]
        else:
            lines = [
                f"ranks {stalled} did not finish within {timeout:g} s {done}, but "
                f"{_ranks(self.busy)} {'was' if len(self.busy) == 1 else 'were'} busy, not "
                f"stalled in a collective: {doing}.",
                "Give long work more time: cluster.run(fn, timeout=600) or %%ranks --timeout 600.",
            ]
        kept = "The work was stopped; the ranks keep their variables."
        lines.append({True: RESTARTED, False: kept, None: "The ranks were stopped."}[restarted])
        super().__init__(" ".join(lines))

    def _render_traceback_(self) -> list[str]:
        r = (self.busy or self.stalled)[0]
        own = _where(r, self.tracebacks, self.states)
        if self.busy:
            did = f"gas_lab: {_ranks(self.stalled)} did not finish within {self.timeout:g} s"
        else:
            did = f"gas_lab: no result from {_ranks(self.stalled)} after {self.timeout:g} s"
        if self.finished:
            did += f" ({_ranks(self.finished)} finished)"
        did += {
            True: "; the ranks were restarted, variables on the ranks are lost",
            False: "; the work was stopped, the ranks keep their variables",
            None: "; the ranks were stopped",
        }[self.restarted]
        if self.busy:
            did += ". More time: cluster.run(fn, timeout=600) or %%ranks --timeout 600"
        return [*own, "", f"{did}. {FULL_REPORT}"]


class LoneCollectiveError(RankStallError):
    """A cell ran on some ranks only (``%%ranks --rank 0``) and one of them waits in a
    collective, which the other ranks never join: it can never complete. Said as soon as it is
    seen, not after the timeout; the ranks were restarted (a rank waiting there cannot be
    stopped). ``.states`` says where each such rank waits."""

    def __init__(self, states: dict, chosen: list[int], others: list[int]):
        self.chosen, self.others = chosen, others
        option = ",".join(map(str, chosen))
        self.said = (
            f"this cell runs on {_ranks(chosen)} only (%%ranks --rank {option}) and "
            f"{_ranks(others)} never {'joins' if len(others) == 1 else 'join'} the collective, so "
            "it can never complete"
        )
        self.fix = "Collectives need every rank: run them in a %%ranks cell without --rank."
        super().__init__(sorted(states), [], 0, states, restarted=True)
        doing = "; ".join(f"rank {r} is {s.text}" for r, s in sorted(states.items()))
        self.args = (f"{doing}, but {self.said}. {RESTARTED} {self.fix}",)

    def __str__(self) -> str:
        return self.args[0]

    def _render_traceback_(self) -> list[str]:
        own = _where(min(self.states), {}, self.states)
        return [
            *own,
            "",
            f"gas_lab: {self.said}; the ranks were restarted, variables on the ranks are lost. "
            + self.fix,
        ]


class RankInterrupt(KeyboardInterrupt):
    """Kernel -> Interrupt during a call on the ranks. ``.restarted`` says whether the work could
    be stopped on the ranks (False: they keep their variables) or the ranks had to be restarted;
    ``.seconds`` how long stopping took."""

    def __init__(
        self,
        message: str,
        restarted: bool,
        seconds: float,
        tracebacks: dict[int, str] | None = None,
        states: dict | None = None,
    ):
        self.restarted, self.seconds, self.message = restarted, seconds, message
        self.tracebacks, self.states = tracebacks or {}, states or {}
        super().__init__(message)

    def _render_traceback_(self) -> list[str]:
        ranks = sorted({*self.tracebacks, *self.states})
        own = _where(ranks[0], self.tracebacks, self.states) if ranks else []
        return [*own, "", f"gas_lab: {self.message} {FULL_REPORT}"]


def _where(rank: int, tracebacks: dict[int, str], states: dict) -> list[str]:
    """Where ``rank`` was: the traceback of the KeyboardInterrupt that stopped it, else its
    sampled stack, else what the sample said."""
    if rank in tracebacks:
        return rank_traceback(tracebacks[rank], rank)
    state = states.get(rank)
    if state is None:
        return []
    if state.frames:
        return stack_lines(rank, state.frames, state.text)
    return [f"rank {rank}: {state.text}"]


def error_text(future) -> str:
    exc = future.exception()
    if exc is None:
        return future.get()[1]
    # ipyparallel failed (the rank died, ...): keep what it says, without colour codes.
    tb = getattr(exc, "traceback", None) or f"{type(exc).__name__}: {exc}"
    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(tb) if isinstance(tb, list) else str(tb))
