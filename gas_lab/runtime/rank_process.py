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
cluster's folder, where the notebook reads it. When the notebook restarts the ranks it kills
them and sends this parent ``SIGUSR1``: the parent forks a new set from its untouched imports
(about a second, instead of a new controller and new imports). It ends with the notebook's
kernel, or when the cluster is stopped.
"""

from __future__ import annotations

import os
import signal

# Blocked from the start, so that no thread an import starts receives them: the parent waits
# for them (below); each rank unblocks them again. Only where ranks are forked (Linux).
_WAITED = {signal.SIGCHLD, signal.SIGUSR1} if os.environ.get("GAS_LAB_RANKS") else set()
if _WAITED:
    signal.pthread_sigmask(signal.SIG_BLOCK, _WAITED)

import torch.distributed  # noqa: E402, F401  (the slow import every rank needs for setup_rank)
from ipyparallel.engine.app import main  # noqa: E402

import gas_lab.dp  # noqa: E402, F401
from gas_lab.runtime.fresh import preload  # noqa: E402
from gas_lab.runtime.lifetime import MARKER, owner_alive  # noqa: E402

if os.environ.get("DS_ACCELERATOR") == "cpu":
    # DeepSpeed and the two modules its first initialize imports lazily, once for every rank:
    # on 2 idle cores the start takes 2.7 s longer and the first deepspeed.initialize 3.7 s less,
    # 4 CPU-seconds fewer in all. Not on GPU ranks: a CUDA runtime touched before a fork is
    # unusable in the children.
    preload()


def _forked(n: int) -> bool:
    """Fork ``n`` ranks; True in each of them (it becomes an engine), False in the parent."""
    for _ in range(n):
        if os.fork() == 0:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _WAITED)
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
    it forks again on ``SIGUSR1``, and exits once the notebook's kernel has gone."""
    if _forked(n):
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Kernel -> Interrupt is for the ranks
    cluster = os.environ.get(MARKER, "")
    while True:
        got = signal.sigtimedwait(_WAITED, 1.0)  # None each second: is the kernel still there?
        _collect(folder)
        if got is not None and got.si_signo == signal.SIGUSR1 and _forked(n):
            return
        if got is None and cluster and not owner_alive(cluster):
            os._exit(0)  # what the guardian would do, had it been killed with the kernel


if __name__ == "__main__":
    ranks, folder = os.environ.pop("GAS_LAB_RANKS", ""), os.environ.pop("GAS_LAB_RANKS_DIR", ".")
    if ranks:  # Linux: this process forks the ranks; elsewhere it is a rank itself
        fork_ranks(int(ranks), folder)
    main()
