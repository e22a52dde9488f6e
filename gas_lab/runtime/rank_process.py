"""The program behind the notebook's ranks: import torch once, fork one process per rank, and
make each an ipyparallel engine.

Importing torch and the process group code is most of a rank's start-up (about 1.6 CPU-seconds
on a laptop core); on CPU ranks DeepSpeed's imports follow (2.8 CPU-seconds more:
:data:`~gas_lab.runtime.fresh.RANK_IMPORTS`). The cluster (:mod:`~gas_lab.runtime.cluster`)
starts this program once; after the imports it forks ``GAS_LAB_RANKS`` ranks, so the import runs
once per cluster, not once per rank, and the ranks share its memory pages until they write to
them. It starts at the same time as ipyparallel's controller, so the imports overlap the
controller's own start-up.

The first process stays the ranks' parent and does nothing else: it collects each rank that
ends, at once (so none lingers as a zombie), and writes how it ended to ``exit-<pid>`` in the
cluster's folder, where the notebook reads it. To restart the ranks the notebook kills them and
writes to the parent's pipe, ``fork`` in that folder (:func:`~gas_lab.runtime.launch.fork_again`):
the parent forks a new set from its untouched imports, in about a second instead of a new
controller and new imports. It ends with the notebook's kernel, or when the cluster is stopped.
"""

from __future__ import annotations

import os
import select
import signal

import torch.distributed  # noqa: F401  (the slow import every rank needs for setup_rank)
from ipyparallel.engine.app import main

import gas_lab.dp  # noqa: F401
from gas_lab.runtime.fresh import preload
from gas_lab.runtime.launch import FORK_PIPE
from gas_lab.runtime.lifetime import MARKER, owner_alive

if os.environ.get("DS_ACCELERATOR") == "cpu":
    # DeepSpeed and the two modules its first initialize imports lazily, once for every rank:
    # on 2 idle cores the start takes 2.7 s longer and the first deepspeed.initialize 3.7 s less,
    # 4 CPU-seconds fewer in all. Not on GPU ranks: a CUDA runtime touched before a fork is
    # unusable in the children.
    preload()


def _forked(n: int, keep: list[int]) -> bool:
    """Fork ``n`` ranks; True in each of them (it becomes an engine), False in the parent."""
    for _ in range(n):
        if os.fork() == 0:  # a rank: none of the parent's waiting is its business
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            for fd in keep:
                os.close(fd)
            return True
    return False


def _collect(folder: str) -> None:
    """Collect every rank that has ended, noting how it ended (negative: the signal)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        with open(os.path.join(folder, f"exit-{pid}"), "w") as f:
            f.write(str(os.waitstatus_to_exitcode(status)))


def fork_ranks(n: int, folder: str) -> None:
    """Fork ``n`` ranks, each of which returns from here; the parent returns only in the ranks
    it forks again when asked, and exits once the notebook's kernel has gone."""
    pipe = os.path.join(folder, FORK_PIPE)
    os.mkfifo(pipe)
    # Read end, and a write end of its own so the pipe never reads as closed between requests.
    requests = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
    keep_open = os.open(pipe, os.O_WRONLY)
    # A rank's end wakes the select below at once: SIGCHLD writes a byte to ``wake``.
    wake, woken = os.pipe()
    os.set_blocking(woken, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(woken)
    fds = [requests, keep_open, wake, woken]
    if _forked(n, fds):
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Kernel -> Interrupt is for the ranks
    cluster = os.environ.get(MARKER, "")
    while True:
        ready, _, _ = select.select([requests, wake], [], [], 1.0)
        if wake in ready:
            os.read(wake, 512)
        _collect(folder)
        if requests in ready and os.read(requests, 512) and _forked(n, fds):
            return
        if not ready and cluster and not owner_alive(cluster):
            os._exit(0)  # what the guardian would do, had it been killed with the kernel


if __name__ == "__main__":
    ranks, folder = os.environ.pop("GAS_LAB_RANKS", ""), os.environ.pop("GAS_LAB_RANKS_DIR", ".")
    if ranks:  # Linux: this process forks the ranks; elsewhere it is a rank itself
        fork_ranks(int(ranks), folder)
    main()
