"""The program the notebook's ranks run: import torch once, fork one process per rank, and make
each an ipyparallel engine.

Importing torch and the process group code is most of a rank's start-up (about 1.6 CPU-seconds
on a laptop core). The cluster (:mod:`~gas_lab.runtime.cluster`) starts this program once; after
the imports it forks ``GAS_LAB_RANKS - 1`` copies of itself, so the import runs once per cluster,
not once per rank, and the ranks share its memory pages until they write to them. It starts at
the same time as ipyparallel's controller, so the imports overlap the controller's own start-up.

The first process is the parent of the others: it notes how each one ended in
``exit-<pid>`` in the cluster's folder, where the notebook reads it when a rank dies.
"""

from __future__ import annotations

import os
import threading

import torch.distributed  # noqa: F401  (the slow import every rank needs for setup_rank)
from ipyparallel.engine.app import main

import gas_lab.dp  # noqa: F401


def fork_ranks(n: int, folder: str) -> None:
    """In the first process: fork ``n - 1`` more ranks; each returns from here as a child."""
    for _ in range(n - 1):
        pid = os.fork()
        if pid == 0:
            return  # a forked rank: it becomes an engine like the first
        threading.Thread(target=_note_exit, args=(pid, folder), daemon=True).start()


def _note_exit(pid: int, folder: str) -> None:
    """Wait for a forked rank to end, and write its exit code (negative: the signal)."""
    _, status = os.waitpid(pid, 0)
    with open(os.path.join(folder, f"exit-{pid}"), "w") as f:
        f.write(str(os.waitstatus_to_exitcode(status)))


if __name__ == "__main__":
    ranks, folder = os.environ.pop("GAS_LAB_RANKS", "1"), os.environ.pop("GAS_LAB_RANKS_DIR", ".")
    fork_ranks(int(ranks), folder)
    main()
