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
ends, at once (so none lingers as a zombie), writes how it ended to ``exit-<pid>`` in the
cluster's folder, where the notebook reads it, and exits after the last one.
"""

from __future__ import annotations

import os
import signal

import torch.distributed  # noqa: F401  (the slow import every rank needs for setup_rank)
from ipyparallel.engine.app import main

import gas_lab.dp  # noqa: F401
from gas_lab.runtime.fresh import preload

if os.environ.get("DS_ACCELERATOR") == "cpu":
    # DeepSpeed and the two modules its first initialize imports lazily, once for every rank:
    # on 2 idle cores the start takes 2.7 s longer and the first deepspeed.initialize 3.7 s less,
    # 4 CPU-seconds fewer in all. Not on GPU ranks: a CUDA runtime touched before a fork is
    # unusable in the children.
    preload()


def fork_ranks(n: int, folder: str) -> None:
    """Fork ``n`` ranks, each of which returns from here; the first process never returns."""
    for _ in range(n):
        if os.fork() == 0:
            return  # a rank: it becomes an engine
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Kernel -> Interrupt is for the ranks
    for _ in range(n):
        pid, status = os.wait()
        with open(os.path.join(folder, f"exit-{pid}"), "w") as f:
            f.write(str(os.waitstatus_to_exitcode(status)))  # negative: the signal
    os._exit(0)


if __name__ == "__main__":
    ranks, folder = os.environ.pop("GAS_LAB_RANKS", ""), os.environ.pop("GAS_LAB_RANKS_DIR", ".")
    if ranks:  # Linux: this process forks the ranks; elsewhere it is a rank itself
        fork_ranks(int(ranks), folder)
    main()
