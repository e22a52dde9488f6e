"""What the notebook can find out about its ranks from outside: which have died and how, what
each is doing (:mod:`~gas_lab.runtime.rank_state`), where one crashed, whether their process
group is in step: ``cluster.watch``, a :class:`RankWatch`. Used by
:class:`~gas_lab.runtime.calls.Call` when a call goes wrong, and by ``cluster.status()``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from gas_lab.runtime import lifetime, rank_state
from gas_lab.runtime.on_rank import sequence_number
from gas_lab.runtime.rank_errors import exit_text


def engine_launchers(ipp_cluster) -> list:
    """ipyparallel's launchers of ``ipp_cluster``'s engines (none if it is None)."""
    if ipp_cluster is None:
        return []
    return [el for es in ipp_cluster.engines.values() for el in es.launchers.values()]


class RankWatch:
    """The ranks of one start of a :class:`~gas_lab.runtime.cluster.Cluster`, watched from
    outside: ``cluster.watch``, made once the rank processes are started (at every start and
    restart), and dropped (None) when the cluster ends.

    It is given what it reads: ``folder``, the ranks' folder (where each rank writes its stack
    and crash report, and their parent how each rank ended); ``launchers``, a function returning
    ipyparallel's engine launchers now; ``view``, a function from a rank to its ipyparallel view;
    and ``ranks``. It owns ``pids`` (the processes started: the ranks' parent, or the ranks, until
    :meth:`ranks_set_up` gives one pid per rank) and ``set_up`` (whether the ranks ran
    ``setup_rank``: before that they cannot be sampled).
    """

    def __init__(
        self, folder: str, launchers: Callable[[], list], view: Callable, ranks: list[int]
    ):
        self.folder, self.launchers, self.view, self.ranks = folder, launchers, view, ranks
        self.pids: list[int] = [e.pid for e in launchers()]
        self.set_up = False

    def ranks_set_up(self, pids: list[int]) -> None:
        """The ranks answered ``setup_rank``: ``pids`` are theirs, and they can be sampled."""
        self.pids, self.set_up = pids, True
        for pid in pids:  # a pid an earlier rank of this cluster had: its exit note is not theirs
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.folder, f"exit-{pid}"))

    def process_output(self) -> dict[str, int]:
        """The files the rank processes' own output goes to (below Python's ``print``: what a
        compiler or ninja started by a rank writes), each with its size now."""
        sizes = {}
        for launcher in self.launchers():
            path = getattr(launcher, "output_file", "")
            try:
                sizes[path] = os.path.getsize(path)
            except OSError:
                continue
        return sizes

    def dead_ranks(self) -> dict[int, str]:
        """Ranks whose process has ended, with how it ended (exit code or signal)."""
        dead = {}
        for r, pid in enumerate(self.pids):
            if not lifetime.running(pid):
                dead[r] = exit_text(self._exit_code(pid))
        return dead

    def _exit_code(self, pid: int, wait: float = 2.0):
        """How rank process ``pid`` ended. A forked rank is the child of the process that forked
        it, which writes how it ended (rank_process.py). A rank started as a process of its own
        (not on Linux) is this process's child: ipyparallel's launcher thread reaps it (a second
        waiter would race it), and psutil keeps the status it got."""
        import time

        deadline = time.monotonic() + wait
        launcher = next((e for e in self.launchers() if e.pid == pid), None)
        if launcher is None:
            return self._noted_exit_code(pid, deadline)
        while time.monotonic() < deadline:
            code = getattr(launcher.process, "_exitcode", None)
            if isinstance(code, int):
                return code
            waiter = getattr(launcher, "_wait_thread", None)
            if waiter is None or not waiter.is_alive():
                try:
                    return launcher.process.wait(timeout=0.1)  # no one else is waiting
                except Exception:
                    return None
            time.sleep(0.02)
        return None

    def _noted_exit_code(self, pid: int, deadline: float):
        """The exit code the ranks' parent wrote for a rank; None if it wrote none (it was
        killed first, and nobody else can know)."""
        import time

        parent = next((e.pid for e in self.launchers()), None)
        while True:
            try:
                with open(os.path.join(self.folder, f"exit-{pid}")) as f:
                    return int(f.read())
            except (OSError, ValueError):
                pass  # not written yet
            if not lifetime.running(parent) or time.monotonic() > deadline:
                return None
            time.sleep(0.02)

    def sample(self, ranks: list[int]) -> dict:
        """What each of ``ranks`` is doing now (:func:`gas_lab.runtime.rank_state.sample`)."""
        if not self.set_up:  # still starting: the signal is not set up
            return {r: rank_state.RankState("unknown", "still starting") for r in ranks}
        return {
            r: rank_state.sample(self.pids[r], os.path.join(self.folder, f"stack-{r}.txt"))
            for r in ranks
        }

    def crash_report(self, rank: int) -> str:
        """Where a rank that died crashed, as Python's fault handler wrote it (may be empty)."""
        try:
            with open(os.path.join(self.folder, f"crash-{rank}.txt")) as f:
                lines = f.read().strip().splitlines()
        except OSError:
            return ""
        # Keep the error and the learner's frames: stop where the runtime called their code.
        kept = []
        for line in lines:
            if "gas_lab/runtime/" in line or line.startswith("Extension modules"):
                break
            kept.append(line)
        return "\n".join(kept).strip()

    def collective_counts(self) -> list[int] | None:
        """Each rank's count of collectives issued on the default group (None if unknown)."""
        try:
            futures = [self.view(r).apply_async(sequence_number) for r in self.ranks]
            return [f.get(timeout=10) for f in futures]
        except Exception:
            return None
