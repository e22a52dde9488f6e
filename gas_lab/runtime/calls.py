"""One call on the ranks, from submission to result: bounded waiting, live output, and errors
that blame the right thing.

* What the ranks print is shown while they run (:mod:`~gas_lab.runtime.streaming`).
* A rank that raises ends the call after the others get :data:`ERROR_GRACE` seconds, or as soon
  as every other rank is seen waiting in a collective the failed rank will never join; a rank that
  dies is reported with its exit code or signal, before the ranks that failed because of it.
* At the timeout the unfinished ranks are sampled (:mod:`~gas_lab.runtime.rank_state`): ranks
  waiting in a collective stalled, and the ranks are restarted; a rank still *starting up*
  (importing, building a C++ op, inside ``deepspeed.initialize``) gets up to
  :data:`STARTUP_LIMIT` seconds, and the work after it gets the call's timeout again; a rank
  still computing is stopped with a KeyboardInterrupt.
* Kernel -> Interrupt stops the work on the ranks the same way; a rank that cannot be stopped
  (blocked in a collective) gets the ranks restarted. The error says which happened.
"""

from __future__ import annotations

import os
import pickle
import signal
import time

from gas_lab.runtime import build_lock
from gas_lab.runtime.notices import notice
from gas_lab.runtime.rank_errors import (
    LoneCollectiveError,
    RankError,
    RankInterrupt,
    RankStallError,
    error_text,
)
from gas_lab.runtime.streaming import RankOutput

ERROR_GRACE = 5.0  # after one rank fails, how long the others get to finish before we stop waiting
STOP_GRACE = 3.0  # how long an interrupted rank gets to stop its work before the ranks restart
STARTUP_LIMIT = 900.0  # the longest a call waits for ranks that are still starting up
# While waiting past the timeout for start-up work, look again this often: start-up that ends
# in a stall (ZeRO-3's initialize, then a collective nobody joins) is caught within a second.
RESAMPLE = 1.0
# ... but a C++ op build takes a minute or more and nothing about it changes in a second: look
# less often, so that the stack samples (a signal to each rank) and the stale-lock checks stay
# rare while a build and the ranks waiting for its lock are in flight.
RESAMPLE_BUILD = 10.0
# A rank's result and its output travel on different channels, so the result can arrive while
# the last of its output is still on the way: wait up to this long for the rest.
OUTPUT_GRACE = 10.0
# PyTorch takes an op's build lock at every first load in a process, built or not, while ninja
# checks the build (well under a second when idle, longer on a loaded machine); a lock held longer
# than this is a build, said as one, once the op's library is missing or a compiler runs for it.
QUIET_LOAD_S = 1.0
# A cell on some ranks only: look for a rank waiting in a collective (which the other ranks never
# join) this soon after the start, and then this often.
ALONE_FIRST = 0.5
ALONE_EVERY = 0.5
# Functions of torch.distributed that return at once (they live beside the collectives): a rank
# sampled inside one is not waiting for the others.
_QUERIES = {"get_rank", "get_world_size", "get_backend", "is_initialized", "get_group_rank"}


def _failed(f) -> bool:
    return f.ready() and (f.exception() is not None or f.get()[0] != "ok")


class Call:
    """Wait for ``futures`` (one per rank of ``cluster``) and turn them into results or an error."""

    def __init__(
        self,
        cluster,
        futures: list,
        timeout: float,
        what: str,
        restart: bool = True,
        ranks: list[int] | None = None,
    ):
        self.cluster, self.futures, self.timeout = cluster, futures, timeout
        self.what, self.restart = what, restart
        self.ranks = cluster.ranks if ranks is None else ranks  # the ranks ``futures`` run on
        # On some ranks only (%%ranks --rank 0), a collective can never complete: watched for.
        self.alone: dict = {}  # rank -> its state, once it was seen waiting in a collective
        self.died: dict[int, str] = {}
        self.states: dict = {}
        self.out = RankOutput(self.ranks, cluster.noise)
        self.ops = build_lock.built_ops()  # to tell which C++ ops this call built
        self.locks = set(build_lock.locks())  # locks that were there before: not this call's
        self.build = None  # the C++ build in flight (_watch_build)
        self.noticed: dict[str, float] = {}  # op -> seconds, builds already said as they ended

    def unfinished(self) -> list[int]:
        return [r for r, f in zip(self.ranks, self.futures, strict=True) if not f.ready()]

    def result(self) -> list:
        __tracebackhide__ = True
        try:
            try:
                self._wait()
            except KeyboardInterrupt:
                self._close_output()
                if not self.restart:  # at start-up: the caller ends the half-started ranks
                    raise
                raise self._interrupted() from None
            self._close_output()
            self._note_builds()
            return self._outcome()
        except (RankError, RankStallError, RankInterrupt) as exc:  # LoneCollectiveError too
            self.cluster.last_error = exc  # the full report, after the notebook shows the gist
            raise

    def _close_output(self) -> None:
        """Show the rest of the output of every rank that answered (ipyparallel's
        ``wait_for_output``), then end the live lines and add the cap's notes."""
        if self.build is not None:
            self._end_build()
        deadline = time.monotonic() + OUTPUT_GRACE
        for f in self.futures:
            if f.ready():
                f.wait_for_output(max(0.0, deadline - time.monotonic()))
        self.out.close(self.futures)

    def _watch_build(self) -> None:
        """A C++ build on a rank (a new build lock held past ``QUIET_LOAD_S`` while the op
        compiles: build_lock.py) is one notice line with a live elapsed time instead of the
        compiler's lines, which go to a log file the line names; when the lock goes, the line
        says "built in N s". A lock that goes before any compiling was a load's: its lines go to
        the cell, and nothing is said."""
        held = [lock for lock in build_lock.locks() if lock not in self.locks]
        now = time.monotonic()
        if self.build is None and held:
            op = os.path.basename(os.path.dirname(held[0]))
            log = os.path.join(os.path.dirname(held[0]), "gas_lab_build.log")
            since = self.cluster.watch.process_output()
            self.build = {"op": op, "log": log, "lock": held[0], "t0": now, "since": since}
            self.build["notice"] = None
            self.out.hold()
        elif self.build is not None:
            b, seconds = self.build, now - self.build["t0"]
            if not held:
                self._end_build()
            elif (
                b["notice"] is None
                and seconds >= QUIET_LOAD_S
                and build_lock.compiling(os.path.dirname(b["lock"]))
            ):
                b["shown"], b["file"] = int(seconds), open(b["log"], "w")
                b["file"].write(f"gas_lab: DeepSpeed's C++ op {b['op']}, built in ")
                b["file"].write(f"{os.path.dirname(b['log'])}\n")
                b["file"].write("--- what the ranks printed during the build ---\n")
                self.out.release(log=b["file"])
                self.out.divert = b["file"]
                b["notice"] = notice(self._building_text(b, seconds))
            elif b["notice"] is not None and seconds - b["shown"] >= 1:
                b["shown"] = int(seconds)
                b["notice"].update(self._building_text(b, seconds))

    @staticmethod
    def _building_text(b: dict, seconds: float) -> str:
        return (
            f"building DeepSpeed's C++ op {b['op']}, once for this environment: {seconds:.0f} s "
            f"(the compiler's output goes to {b['log']})"
        )

    def _end_build(self) -> None:
        b, self.build = self.build, None
        if b["notice"] is None:  # a load's lock (a build this short, _note_builds says)
            self.out.release()
            return
        self.out.pump(self.futures)  # the build's last lines still go to its log
        self.out.divert = None
        for path, start in b["since"].items():  # ninja's and the compiler's own lines
            with open(path, errors="replace") as f:
                f.seek(start)
                b["file"].write(f.read())
        try:  # the compiler's commands (PyTorch shows their output only when a build fails)
            with open(os.path.join(os.path.dirname(b["lock"]), "build.ninja")) as f:
                b["file"].write("--- the commands ninja ran (build.ninja) ---\n" + f.read())
        except OSError:
            pass
        b["file"].close()
        seconds = time.monotonic() - b["t0"]
        if os.path.exists(b["lock"]):  # the call ended first (an interrupt, a failure)
            text = f"the build of DeepSpeed's C++ op {b['op']} had not finished after "
            b["notice"].update(text + f"{seconds:.0f} s; its log: {b['log']}", final=True)
            return
        self.noticed[b["op"]] = seconds
        b["notice"].update(self._built_text(b["op"], seconds, b["log"]), final=True)

    @staticmethod
    def _built_text(op: str, seconds: float, log: str | None) -> str:
        text = (
            f"built DeepSpeed's C++ op {op} in {seconds:.0f} s, once for this environment: it "
            f"is kept in {build_lock.extensions_root()}"
        )
        return text + (f"; full log: {log}" if log else "")

    def _note_builds(self) -> None:
        """Keep the C++ ops the ranks built during this call in ``cluster.built``, and say any
        build not already said as it ended. (DeepSpeed prints "built successfully" whenever it
        loads an op, built or not: the runtime hides that line.)"""
        for op, seconds in build_lock.builds_since(self.ops).items():
            self.cluster.built[op] = seconds
            if op not in self.noticed:
                notice(self._built_text(op, seconds, None))

    # -- waiting ------------------------------------------------------------------------------
    def _wait(self) -> None:
        start = time.monotonic()
        deadline, first_bad, next_look, noted = start + self.timeout, None, 0.0, set()
        work_timed = False  # the work after start-up got the call's own timeout
        partial = self.ranks != self.cluster.ranks
        next_alone, seen = start + ALONE_FIRST, {}
        next_wait, waiting = 0.0, {}  # after a failure: the others, waiting in collectives
        # A rank that died never answers (nothing relays its death to ipyparallel): once every
        # other rank has answered, there is nothing left to wait for.
        while any(r not in self.died for r in self.unfinished()):
            self.out.pump(self.futures)
            now = time.monotonic()
            if now >= next_look:
                self.died.update(self.cluster.watch.dead_ranks())
                self._watch_build()
                next_look = now + 0.25
            if first_bad is None and (self.died or any(map(_failed, self.futures))):
                first_bad = next_wait = now
            if first_bad is not None and now - first_bad > ERROR_GRACE:
                return
            if first_bad is not None and now >= next_wait:
                if self._all_wait_in_collectives(waiting):
                    return
                next_wait = time.monotonic() + ALONE_EVERY
            if partial and now >= next_alone and self.cluster.watch.set_up:
                if self._alone_in_collective(seen):
                    return
                next_alone = time.monotonic() + ALONE_EVERY
            if now > deadline:
                self.states = self.cluster.watch.sample(self.unfinished())
                starting = {r: s for r, s in self.states.items() if s.starting_up}
                if now - start > STARTUP_LIMIT:
                    return
                if not starting:
                    if not noted or work_timed or self._any_in_collective():
                        return
                    # Start-up work ended since the last look, and the ranks now compute: the
                    # timeout is for the work itself, which may have begun a moment ago.
                    work_timed, deadline = True, now + self.timeout
                    continue
                for r, s in starting.items():
                    if (r, s.kind) not in noted:
                        # noted even when unsaid: after start-up the work gets its own timeout
                        noted.add((r, s.kind))
                        if self.build is not None and s.kind in ("building", "build_lock"):
                            continue  # the build's own line says it
                        notice(
                            f"rank {r} is still {s.text} after {now - start:.0f} s: start-up "
                            f"work, so the call waits for it (up to {STARTUP_LIMIT:g} s)"
                        )
                kinds = {s.kind for s in starting.values()}
                if "build_lock" in kinds:  # one check covers every waiting rank's lock
                    build_lock.clear_stale_locks()
                building = bool(kinds & {"building", "build_lock"})
                deadline = now + (RESAMPLE_BUILD if building else RESAMPLE)
            time.sleep(0.05)

    @staticmethod
    def _seen_waiting(states: dict, seen: dict) -> set[int]:
        """The ranks of ``states`` seen twice in the same collective (``seen``: each one's last
        place): a rank passing through (``dist.get_rank()`` lives beside them) does not wait."""
        waiting = set()
        for r, state in states.items():
            if state.kind != "collective" or _QUERIES & {fn for _, _, fn in state.frames}:
                seen.pop(r, None)
                continue
            if seen.get(r) == state.frames:
                waiting.add(r)
            seen[r] = state.frames
        return waiting

    def _alone_in_collective(self, seen: dict) -> bool:
        """Whether a chosen rank waits in a collective (:meth:`_seen_waiting`)."""
        states = self.cluster.watch.sample(self.unfinished())
        for r in self._seen_waiting(states, seen):
            self.alone[r] = self.states[r] = states[r]
        return bool(self.alone)

    def _all_wait_in_collectives(self, seen: dict) -> bool:
        """After a rank failed: whether every other unfinished rank waits in a collective, which
        the failed rank never joins (:data:`ERROR_GRACE` would only be waited out)."""
        live = [r for r in self.unfinished() if r not in self.died]
        states = self.cluster.watch.sample(live)
        if live and self._seen_waiting(states, seen) == set(live):
            self.states.update(states)
            return True
        return False

    def _any_in_collective(self) -> bool:
        return any(s.kind == "collective" for s in self.states.values())

    def _stop_work(self, ranks: list[int]) -> str | None:
        """Interrupt ``ranks`` and wait for their work to stop. None if it stopped with the
        process group still in step; otherwise why the ranks had to be restarted."""
        self.states = states = self.states or self.cluster.watch.sample(ranks)
        stuck = {r: s for r, s in states.items() if r in ranks and s.kind == "collective"}
        if not stuck:
            for r in ranks:
                # Until the ranks answer, pids holds the process that forks them (which ignores
                # SIGINT), not yet one pid per rank.
                if r < len(self.cluster.pids):
                    os.kill(self.cluster.pids[r], signal.SIGINT)  # a KeyboardInterrupt there
            deadline = time.monotonic() + STOP_GRACE
            try:
                while self.unfinished() and time.monotonic() < deadline:
                    self.out.pump(self.futures)
                    time.sleep(0.05)
            except KeyboardInterrupt:
                pass  # interrupted again: no more waiting, restart
            self._close_output()
            left = self.unfinished()
            if not left:
                counts = self.cluster.watch.collective_counts()
                if counts is not None and len(set(counts)) == 1:
                    return None
                return (
                    f"the ranks had issued different numbers of collectives ({counts}), so "
                    "their process group was out of step"
                )
            stuck = self.cluster.watch.sample(left)
            self.states.update(stuck)
        return "; ".join(
            f"rank {r} was {s.text} and cannot be stopped there" for r, s in stuck.items()
        )

    def _interrupted(self) -> RankInterrupt:
        t0 = time.monotonic()
        ranks = self.unfinished()
        why = self._stop_work(ranks) if ranks else None
        if why is not None:
            self.cluster.restart()
        seconds = time.monotonic() - t0
        if not ranks:
            msg = "Interrupted: the ranks had just finished; their results were dropped."
        elif why is None:
            msg = (
                f"Interrupted: the work on ranks {ranks} stopped after {seconds:.1f} s (each got a "
                "KeyboardInterrupt); the ranks keep their variables."
            )
        else:
            msg = (
                f"Interrupted: {why}, so the ranks were restarted ({seconds:.1f} s); variables on "
                "the ranks are lost."
            )
        return RankInterrupt(msg, why is not None, seconds, self._stopped(ranks), self.states)

    def _stopped(self, ranks: list[int]) -> dict[int, str]:
        """Where each of ``ranks`` was stopped: the traceback of its KeyboardInterrupt."""
        ranked = zip(self.ranks, self.futures, strict=True)
        return {r: error_text(f) for r, f in ranked if r in ranks and _failed(f)}

    # -- the outcome --------------------------------------------------------------------------
    def _outcome(self) -> list:
        __tracebackhide__ = True
        ranked = list(zip(self.ranks, self.futures, strict=True))
        self.died.update(self.cluster.watch.dead_ranks())
        errors, unsendable = {}, {}
        for r, f in ranked:
            if not _failed(f) or r in self.died:
                continue
            kind = "error" if f.exception() is not None else f.get()[0]
            (unsendable if kind == "unsendable" else errors)[r] = error_text(f)
        stalled = [r for r, f in ranked if not f.ready() and r not in self.died]
        anew, self.cluster.started_anew = self.cluster.started_anew, False  # said once, here
        if self.alone and not (self.died or errors or unsendable):
            others = [r for r in self.cluster.ranks if r not in self.ranks]
            self.cluster.restart()  # blocked in C++: nothing but a restart stops it
            raise LoneCollectiveError(self.alone, self.ranks, others)
        if self.died or errors or unsendable:
            restarted = bool(self.died or stalled) and self.restart
            crash = {r: self.cluster.watch.crash_report(r) for r in self.died}
            if restarted:
                self.cluster.restart()
            raise RankError(
                errors,
                stalled,
                restarted,
                died=self.died,
                unsendable=unsendable,
                crash={r: t for r, t in crash.items() if t},
                what=self.what,
                started_anew=anew,
                ranks=self.ranks,
            )
        if stalled:
            states = self.states or self.cluster.watch.sample(stalled)
            finished = [r for r in self.ranks if r not in stalled]
            if not self.restart:  # at start-up: the caller stops the ranks
                raise RankStallError(stalled, finished, self.timeout, states, restarted=None)
            why = self._stop_work(stalled)
            stopped = self._stopped(stalled) if why is None else {}
            if why is not None:
                self.cluster.restart()
            raise RankStallError(stalled, finished, self.timeout, states, why is not None, stopped)
        return [pickle.loads(f.get()[1]) for f in self.futures]
