"""How a cluster's processes start: ipyparallel's controller, and the ranks' parent
(:mod:`~gas_lab.runtime.rank_process`), which imports torch once and forks the ranks; and how
the ranks alone start again, forked anew by that parent, when a call has to restart them.

A restart (after a rank died, stalled, or was left waiting in a collective) kills only the
ranks: the controller and the parent hold nothing a failure can spoil (the parent never runs the
learner's code), so the parent forks a new set from its imports. On Linux that takes about a
second, where a new controller and new imports took five; elsewhere, and whenever the parent
does not answer, everything starts anew.
"""

from __future__ import annotations

import logging
import os
import sys

import psutil

from gas_lab.runtime import build_lock, lifetime
from gas_lab.runtime.watch import engine_launchers

# ipyparallel's hub admits a new engine only at a heartbeat after the engine first answered one:
# with its default 3 s period, start-up waited 3-6 s for no reason. A fast period admits the
# ranks within a fraction of a second; the number of missed beats tolerated is raised with it so
# an engine (or the controller) still counts as gone only after 30 s of silence, as before.
_HEARTBEAT_MS = 100
_CONTROLLER_ARGS = [
    f"--HeartMonitor.period={_HEARTBEAT_MS}",
    f"--HeartMonitor.max_heartmonitor_misses={30_000 // _HEARTBEAT_MS}",
    # ipyparallel's schedulers (hub, queues, broadcast tree: 8 processes by default) as threads
    # of the controller: 2 ranks talk to one notebook, nothing to spread over cores.
    "--IPController.use_threads=True",
]
_ENGINE_ARGS = [
    f"--IPEngine.max_heartbeat_misses={30_000 // (_HEARTBEAT_MS + 500)}",
    # ipyparallel's "nanny" (one more Python process per rank, started while the rank registers)
    # relays signals and deaths through the controller; the runtime signals ranks by pid and
    # watches them itself, so it is not needed.
    "--IPEngine.enable_nanny=False",
    # A rank starts before the controller has written its connection file (below) and waits for
    # it; a loaded machine can take seconds to start the controller.
    "--IPEngine.wait_for_url_file=120",
]
_RANK_CMD = [sys.executable, "-m", "gas_lab.runtime.rank_process"]
# One process is started, imports torch and forks the ranks (rank_process.py). Linux only:
# elsewhere forking a process that has imported torch is not known to be safe (macOS), or
# impossible (Windows), and every rank is started and imports torch itself.
FORK_RANKS = sys.platform == "linux"
FORK_PIPE = "fork"  # the parent's named pipe in the cluster's folder: a byte asks for new ranks


def rank_env(world_size: int, backend: str, master_port: int, tmp: str, marker: dict) -> dict:
    """The environment of the ranks: what torchrun sets, and where their parent notes exits."""
    env = {
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        # Share the cores instead of every rank spawning one thread per core.
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // world_size)),
        "PYTHONUNBUFFERED": "1",
        "GAS_LAB_RANKS": str(world_size) if FORK_RANKS else "",
        "GAS_LAB_RANKS_DIR": tmp,  # where their parent notes how each rank ended
        **marker,
    }
    if backend == "gloo":
        # CPU ranks even on a GPU machine: hide the GPUs so every layer agrees.
        env.update(DS_ACCELERATOR="cpu", GLOO_SOCKET_IFNAME="lo", CUDA_VISIBLE_DEVICES="")
    else:
        # A notebook (or make) that set DS_ACCELERATOR=cpu must not leak it into GPU ranks.
        env.update(DS_ACCELERATOR="cuda")
    return env


def start_processes(cluster_id: str, tmp: str, world_size: int, env: dict, marker: dict):
    """Start the controller and the ranks (their parent, on Linux); the ipyparallel cluster."""
    import ipyparallel as ipp
    from traitlets.config import Config

    cluster = ipp.Cluster(
        n=world_size,
        controller_ip="127.0.0.1",
        log_level=logging.ERROR,  # engines exit non-zero when stopped; that is not news
        cluster_id=cluster_id,
        # Connection files and logs in our own folder, removed with it; our stop is fast
        # (a kill), so ipyparallel's own stop at exit (seconds) is not wanted.
        profile_dir=os.path.join(tmp, "profile"),
        shutdown_atexit=False,
        controller_args=_CONTROLLER_ARGS,
        # The ranks' parent starts together with the controller and imports torch while it
        # starts, then forks the ranks (rank_process.py); each waits for the controller's
        # connection file itself.
        send_engines_connection_env=False,
        config=Config(
            LocalEngineSetLauncher={"engine_cmd": _RANK_CMD, "engine_args": _ENGINE_ARGS}
        ),
    )
    cluster.start_controller_sync(environment=marker)
    cluster.start_engines_sync(1 if FORK_RANKS else world_size, environment=env)
    return cluster


def fork_again(ipp_cluster, cluster_id: str, tmp: str) -> bool:
    """Kill the ranks and ask their parent for new ones, which register as new engines; False
    (nothing done) where no parent listens on the cluster's pipe or the controller has ended."""
    if not (FORK_RANKS and ipp_cluster.controller.running):
        return False
    try:  # fails (ENXIO) unless the parent is there, reading the pipe
        ask = os.open(os.path.join(tmp, FORK_PIPE), os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        parent = psutil.Process(engine_launchers(ipp_cluster)[0].pid)
        if parent.environ().get(lifetime.MARKER) != cluster_id:
            return False  # not this cluster's process (a reused pid)
        lifetime.end_processes(parent.children(recursive=True))  # every rank it forked
        build_lock.clear_stale_locks()  # a rank killed while it built or loaded an op leaves its lock
        for name in os.listdir(tmp):  # the dead ranks' stacks and crash reports
            if name.startswith(("stack-", "crash-")):
                os.remove(os.path.join(tmp, name))
        os.write(ask, b"f")
        return True
    except (OSError, IndexError, psutil.Error):
        return False
    finally:
        os.close(ask)
