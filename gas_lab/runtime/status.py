"""What the notebook's ranks are and do, in one call: ``cluster.status()`` or ``%ranks_status``
(lesson 00). Per rank its pid, device, memory and whether it is idle or busy (and where); then
the whole notebook's processes, and other notebooks' ranks on this machine with how to stop them.

Memory is PSS (proportional set size): the ranks are forked from one process and share most of
their pages with it, so resident memory (RSS) would count the same pages once per process; PSS
splits each shared page among the processes that share it, so the numbers add up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from gas_lab.runtime import lifetime
from gas_lab.runtime.notices import notice

STOP_OTHERS = (
    "to stop them, start with gas_lab.start_cluster(stop_others=True), or shut that "
    "notebook's kernel down"
)


@dataclass
class RankRow:
    rank: int
    pid: int
    device: str
    mb: float
    state: str  # "idle", "busy: <what it is doing>", or how it ended


@dataclass
class RanksStatus:
    """What :meth:`Cluster.status` returns; shown as a small table."""

    world_size: int
    backend: str
    running: bool
    ranks: list[RankRow] = field(default_factory=list)
    processes: int = 0  # every process of this notebook's cluster (ranks, their parent, ...)
    mb: float = 0.0
    others: list[dict] = field(default_factory=list)  # lifetime.other_clusters()

    def __repr__(self) -> str:
        if not self.running:
            lines = [
                "gas_lab: this notebook's ranks are not running (the next rank cell starts them)."
            ]
        else:
            lines = [
                f"gas_lab: this notebook's ranks: {self.world_size} ranks ({self.backend}), "
                f"{self.processes} processes, {self.mb:.0f} MB (PSS)",
                f"{'rank':>4}  {'pid':>7}  {'device':<7} {'memory':>8}  state",
            ]
            lines += [
                f"{r.rank:>4}  {r.pid:>7}  {r.device:<7} {r.mb:>5.0f} MB  {r.state}"
                for r in self.ranks
            ]
        if self.others:
            listed = ", ".join(map(running_text, self.others))
            lines.append(f"Other notebooks' ranks on this machine: {listed}; {STOP_OTHERS}.")
        else:
            lines.append("No other notebook's ranks run on this machine.")
        return "\n".join(lines)


def ranks_status(cluster) -> RanksStatus:
    """The status of ``cluster`` (a :class:`~gas_lab.runtime.cluster.Cluster`)."""
    from gas_lab.runtime import lifetime

    others = lifetime.other_clusters()
    status = RanksStatus(cluster.world_size, cluster.backend, cluster.running, others=others)
    if not status.running:
        return status
    dead = cluster.watch.dead_ranks()
    queued = cluster.queued()
    busy = [r for r in cluster.ranks if r not in dead and queued.get(r)]
    states = cluster.watch.sample(busy) if busy else {}
    for r, pid in zip(cluster.ranks, cluster.pids, strict=True):
        if r in dead:
            state = f"ended ({dead[r]})"
        elif r in states:
            state = f"busy: {states[r].text}"
        else:
            state = "idle"
        device = "cpu" if cluster.backend == "gloo" else f"cuda:{r}"
        status.ranks.append(RankRow(r, pid, device, lifetime.memory_mb([_proc(pid)]), state))
    procs = lifetime.cluster_processes(cluster.cluster_id)
    if cluster._guardian is not None and _proc(cluster._guardian.pid) is not None:
        procs.append(_proc(cluster._guardian.pid))  # not marked: it must outlive the marked ones
    status.processes, status.mb = len(procs), lifetime.memory_mb(procs)
    return status


def _proc(pid: int):
    import psutil

    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def running_text(c: dict) -> str:
    """``04_unmanaged.ipynb (5 processes, 306 MB)``: another notebook's ranks, memory as PSS."""
    return f"{c['notebook']} ({c['processes']} processes, {c['mb']:.0f} MB)"


def name_others() -> None:
    """One line naming the ranks other notebooks left running, and how to stop them: on a
    laptop they hold memory (and cores, while they work) that these ranks need."""
    others = lifetime.other_clusters()
    if others:
        whose = "another notebook's" if len(others) == 1 else f"{len(others)} other notebooks'"
        notice(
            f"{whose} ranks are running: {', '.join(map(running_text, others))}. "
            f"They share this machine's cores and memory; {STOP_OTHERS}."
        )


def stop_others_ranks() -> None:
    me = os.path.basename(os.environ.get("JPY_SESSION_NAME", "")) or "another notebook"
    for c in lifetime.other_clusters():
        with open(os.path.join(c["folder"], "stopped_by"), "w") as f:  # that notebook says so
            f.write(me)
        lifetime.end_cluster(c["id"], None)  # its folder stays: its kernel still owns it
        notice(
            f"stopped the ranks of {running_text(c)}; that notebook starts fresh ranks at its "
            "next rank cell."
        )
