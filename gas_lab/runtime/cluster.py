"""The notebook's multi-process runtime: persistent ranks that a notebook starts once.

Distributed training needs several processes ("ranks") that talk through collectives. A
notebook kernel is one process, and starting DeepSpeed takes seconds, so the ranks here are
started once and reused by every cell::

    cluster = gas_lab.start_cluster()          # 2 CPU ranks (gloo), or one per GPU (nccl)
    cluster.run(fn, *args)                     # fn(*args) on every rank -> [result of rank 0, ...]

    %%ranks                                    # a whole cell on every rank, output prefixed
    print(dist.get_rank())

Each rank is an ipyparallel engine with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set and a default process group
initialized, exactly what ``torchrun`` would give a script. Everything listens on loopback.

What the ranks print appears in the cell while they run, and a ``tqdm`` bar on a rank is one
live line. Failures end the call instead of hanging it (:mod:`~gas_lab.runtime.calls`): an
exception on a rank raises :class:`RankError` naming that rank, with its traceback; a rank that
dies is named with its exit code or signal; a rank that does not finish in time raises
:class:`RankStallError`, which says whether it was waiting in a collective (the ranks are then
restarted: a half-finished collective poisons the process group, and variables on the ranks
are lost) or busy. Kernel -> Interrupt stops the work on the ranks. Every process started here
ends with the kernel, however the kernel ends (:mod:`~gas_lab.runtime.lifetime`).
"""

from __future__ import annotations

import atexit
import os
import tempfile
import time

from gas_lab.runtime import build_lock, lifetime
from gas_lab.runtime.arguments import (
    UsageError,
    check_seconds,
    check_world_size,
    default_world_size,
)
from gas_lab.runtime.calls import Call
from gas_lab.runtime.fresh import free_port
from gas_lab.runtime.launch import fork_again, rank_env, start_processes
from gas_lab.runtime.magic import register_magic
from gas_lab.runtime.notices import notice
from gas_lab.runtime.on_rank import call_on_rank, exec_on_rank, remember_source, setup_rank
from gas_lab.runtime.rank_errors import RankError, RankInterrupt, RankStallError  # noqa: F401
from gas_lab.runtime.sending import ship_module_by_value, source_of
from gas_lab.runtime.status import name_others, ranks_status, stop_others_ranks
from gas_lab.runtime.streaming import DEEPSPEED_NOISE
from gas_lab.runtime.values import show_values
from gas_lab.runtime.watch import RankWatch, engine_launchers

DEFAULT_TIMEOUT = 60.0  # seconds a call may run before its unfinished ranks count as stalled


def _listed(ranks: list[int]) -> str:
    return ",".join(map(str, ranks))


class Cluster:
    """A set of persistent rank processes. Use :func:`start_cluster` to get one."""

    noise = DEEPSPEED_NOISE

    def __init__(self, world_size: int, backend: str, pg_timeout: float = 120.0):
        self.world_size, self.backend, self.pg_timeout = world_size, backend, pg_timeout
        self._ipp = self._client = self._guardian = self._tmp = self.cluster_id = None
        self.watch: RankWatch | None = None  # the ranks' pids, deaths, states: while they run
        self.startup_seconds = 0.0
        self.stopped_by_user = False
        self.started_anew = False  # by a call: its error says earlier variables are gone
        self.last_error = None  # the last failed call's error; str() is its full report
        self.built: dict[str, float] = {}  # C++ ops the ranks built (seconds): once per environment

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> Cluster:
        try:
            return self._start()
        except BaseException:
            self._end()  # a failed start leaves nothing behind
            raise

    def _start(self) -> Cluster:
        t0 = time.perf_counter()
        self.stopped_by_user = False
        self.master_port = free_port()
        self.cluster_id = lifetime.new_cluster_id(self.master_port)
        self._tmp = tempfile.mkdtemp(prefix=lifetime.TMP_PREFIX)
        with open(os.path.join(self._tmp, "cluster_id"), "w") as f:
            f.write(self.cluster_id)
        with open(os.path.join(self._tmp, "notebook"), "w") as f:  # Jupyter names it
            f.write(os.path.basename(os.environ.get("JPY_SESSION_NAME", "")))
        self._guardian = lifetime.start_guardian(self.cluster_id, self._tmp)
        marker = {lifetime.MARKER: self.cluster_id}
        env = rank_env(self.world_size, self.backend, self.master_port, self._tmp, marker)
        self._ipp = start_processes(self.cluster_id, self._tmp, self.world_size, env, marker)
        # ipyparallel waits 10 s for the hub's first answer; a controller still starting on a
        # loaded machine (3 test workers, a C++ build) missed that once in 6 runs.
        self._client = self._ipp.connect_client_sync(timeout=120)
        return self._set_up(t0, old=set())

    def _set_up(self, t0: float, old: set, wait: float = 120) -> Cluster:
        """Once the rank processes run: wait for them as engines (those not in ``old``), then
        join them in a process group (a new file store for each set of ranks)."""
        deadline = time.monotonic() + wait
        while len(new := set(self._client.ids) - old) < self.world_size:
            launchers = engine_launchers(self._ipp)
            gone = not all(lifetime.running(e.pid) for e in launchers)
            if gone or not self._ipp.controller.running or time.monotonic() > deadline:
                raise TimeoutError(f"{self.world_size} ranks did not register as engines")
            time.sleep(0.05)
        self._engines = sorted(new)[: self.world_size]  # rank r -> engine id
        self._client[self._engines].use_cloudpickle()  # ship functions defined in the notebook
        store = os.path.join(self._tmp, f"store-{self._engines[0]}")
        args = (store, self.pg_timeout, self._tmp, self.cluster_id)
        futures = [
            self._view(r).apply_async(call_on_rank, setup_rank, (r, *args), {}) for r in self.ranks
        ]
        # The processes started (the ranks' parent, or the ranks): watched until the ranks answer.
        self.watch = RankWatch(
            self._tmp, lambda: engine_launchers(self._ipp), self._view, self.ranks
        )
        infos = Call(self, futures, timeout=120, what="start-up", restart=False).result()
        self.watch.ranks_set_up([i["pid"] for i in infos])
        self.startup_seconds = time.perf_counter() - t0
        return self

    def stop(self) -> None:
        """End every rank process and the controller. Safe to call twice. A later call on this
        cluster starts fresh ranks, and says that variables on the old ones are gone."""
        self._end()
        self.stopped_by_user = True

    def _end(self) -> None:
        """End every process of the cluster, at once, and remove its folder."""
        if self._guardian is None and self._ipp is None:
            return
        try:
            if self._client is not None:
                self._client.close()
        except Exception:
            pass
        # Ranks hold no state worth saving, and a rank stuck in a collective ignores a polite
        # stop, so every process of the cluster is killed outright.
        lifetime.end_cluster(self.cluster_id, self._tmp, self.pids)
        lifetime.stop_guardian(self._guardian)
        self._ipp = self._client = self._guardian = self.watch = None
        build_lock.clear_stale_locks()  # a rank killed while it built or loaded an op leaves its lock

    def restart(self) -> Cluster:
        """Fresh ranks: forked anew by their parent while it and the controller run (about a
        second, :func:`~gas_lab.runtime.launch.fork_again`), else everything started anew."""
        t0, old = time.perf_counter(), set(self._client.ids) if self._client else set()
        if self._ipp is not None and fork_again(self._ipp, self.cluster_id, self._tmp):
            last_error = self.last_error
            try:
                return self._set_up(t0, old, wait=30)
            except Exception as exc:  # e.g. the parent died: start everything anew
                self.last_error = last_error
                notice(f"the ranks' parent did not start new ranks ({exc}); starting anew")
            except BaseException:  # an interrupt: nothing half-started is kept
                self._end()
                raise
        self._end()
        return self.start()

    @property
    def pids(self) -> list[int]:
        """The rank processes' pids ([] when no ranks run)."""
        return [] if self.watch is None else self.watch.pids

    @property
    def running(self) -> bool:
        return self.watch is not None and self.pids != [] and not self.watch.dead_ranks()

    @property
    def ranks(self) -> list[int]:
        return list(range(self.world_size))

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<gas_lab Cluster: {self.world_size} ranks, {self.backend}, {state}>"

    # -- running work -------------------------------------------------------------------------
    def _view(self, rank: int):
        return self._client[self._engines[rank]]

    def run(self, fn, *args, timeout: float = DEFAULT_TIMEOUT, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return ``[result on rank 0, ...]``.

        What the ranks print is shown here while they run, prefixed with the rank.
        """
        __tracebackhide__ = True
        timeout = check_seconds(timeout)
        self._ensure_running()
        what = getattr(fn, "__qualname__", None) or repr(fn)
        return Call(self, self._submit(fn, *args, **kwargs), timeout, what).result()

    def execute(
        self,
        code: str,
        timeout: float = DEFAULT_TIMEOUT,
        cell: str | None = None,
        ranks: list[int] | None = None,
    ) -> None:
        """Run source code on every rank (or on ``ranks``), in each rank's persistent namespace
        (``%%ranks``). A last line that is an expression shows each rank's value, as Jupyter
        shows a cell's ``Out`` (:mod:`~gas_lab.runtime.values`). ``cell`` names it in
        tracebacks (``In[7]``, what ``%%ranks`` passes)."""
        __tracebackhide__ = True
        timeout = check_seconds(timeout)
        chosen = self._check_ranks(ranks)
        self._ensure_running()
        name = f"<%%ranks {cell or abs(hash(code))}>"
        remember_source(name, code.splitlines(keepends=True))  # for a stalled rank's stack
        futures = [
            self._view(r).apply_async(call_on_rank, exec_on_rank, (code, name), {}) for r in chosen
        ]
        what = (
            "the %%ranks cell"
            if chosen == self.ranks
            else f"the %%ranks --rank {_listed(chosen)} cell"
        )
        values = Call(self, futures, timeout, what, ranks=chosen).result()
        show_values(chosen, values, cell)

    def _check_ranks(self, ranks: list[int] | None) -> list[int]:
        if ranks is None:
            return self.ranks
        wrong = [r for r in ranks if not 0 <= r < self.world_size]
        if wrong or not ranks:
            raise UsageError(
                f"%%ranks --rank {_listed(ranks)}: this notebook has ranks 0 to "
                f"{self.world_size - 1} (cluster.world_size is {self.world_size})"
            )
        return sorted(set(ranks))

    def status(self):
        """Each rank's pid, device, memory (PSS) and whether it is idle or busy (and where), this
        notebook's processes, and other notebooks' ranks on this machine with how to stop them
        (:mod:`~gas_lab.runtime.status`; ``%ranks_status`` in a notebook)."""
        return ranks_status(self)

    def queued(self) -> dict[int, int]:
        """How many calls each rank has not finished (ipyparallel's queue status)."""
        try:
            found = self._client.queue_status(self._engines)
        except Exception:
            return {}
        return {r: found.get(e, {}).get("queue", 0) for r, e in enumerate(self._engines)}

    def push(self, **names) -> None:
        """Copy notebook variables into every rank's namespace."""
        self._ensure_running()
        self._client[self._engines].push(names, block=True)

    def pull(self, name: str) -> list:
        """A variable from every rank's namespace, as ``[value on rank 0, ...]``."""
        self._ensure_running()
        return [self._view(r).pull(name, block=True) for r in self.ranks]

    def _submit(self, fn, *args, **kwargs) -> list:
        for obj in (fn, *args, *kwargs.values()):
            ship_module_by_value(obj)
        source = source_of(fn)
        return [
            self._view(r).apply_async(call_on_rank, fn, args, kwargs, source) for r in self.ranks
        ]

    def _ensure_running(self) -> None:
        if self.running:
            return
        if self.stopped_by_user:
            why = "the ranks had been stopped (cluster.stop() or gas_lab.stop_cluster())"
        elif self._ipp is None:
            why = "the ranks were not running"
        elif os.path.exists(os.path.join(self._tmp, "stopped_by")):
            with open(os.path.join(self._tmp, "stopped_by")) as f:
                why = (
                    f"the ranks had been stopped from {f.read()} (start_cluster(stop_others=True))"
                )
        else:
            dead = "; ".join(f"rank {r} {how}" for r, how in self.watch.dead_ranks().items())
            why = f"a rank had ended ({dead})"
        notice(
            f"{why}, so {self.world_size} fresh ranks are starting; variables defined on the "
            "ranks by earlier cells are gone: re-run the cells that defined them."
        )
        self.restart()
        self.started_anew = True


_current: Cluster | None = None


def start_cluster(
    world_size: int | None = None,
    restart: bool = False,
    device: str | None = None,
    stop_others: bool = False,
) -> Cluster:
    """Start the notebook's ranks, or return the ones already running.

    ``world_size=None`` means 2 CPU ranks (gloo, ``DS_ACCELERATOR=cpu``) on a machine without a
    GPU and one rank per GPU (nccl) otherwise. ``device="cpu"`` forces CPU ranks on a GPU
    machine (the course's tests do, so they check the same thing everywhere). Asking for a
    different world size or device, or ``restart=True``, stops the running ranks first, so
    processes never pile up; ranks an earlier kernel left behind are ended too.

    Ranks another notebook started (its kernel still running) are named when new ranks start;
    ``stop_others=True`` stops them (that notebook gets fresh ranks at its next rank cell).
    """
    global _current
    world_size = check_world_size(world_size)
    gpus, default_backend = default_world_size()
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"device={device!r}: use 'cpu', 'cuda' or None (automatic)")
    if device == "cuda" and default_backend != "nccl":
        raise ValueError("device='cuda' but torch sees no GPU on this machine")
    backend = "gloo" if device == "cpu" else default_backend
    world_size = world_size or (2 if backend == "gloo" else gpus)
    if backend == "nccl" and world_size > gpus:
        raise ValueError(
            f"world_size={world_size} but this machine has {gpus} GPUs: nccl needs one "
            "GPU per rank. Use world_size <= the GPU count, or device='cpu'."
        )
    if stop_others:
        stop_others_ranks()
    if _current is not None and _current.running and not restart:
        if (_current.world_size, _current.backend) == (world_size, backend):
            return _current
    if _current is not None:
        _current._end()
        _current = None
    ended = lifetime.end_orphans()
    if ended:
        notice(f"ended {ended} processes an earlier kernel left running")
    build_lock.clear_stale_locks()
    if not stop_others:
        name_others()
    _current = Cluster(world_size, backend).start()
    started = _current
    register_magic(lambda: _current or started, DEFAULT_TIMEOUT)
    return _current


def stop_cluster() -> None:
    """Stop the running ranks, if any (also done automatically when the kernel exits)."""
    global _current
    if _current is not None:
        _current.stop()
        _current = None


atexit.register(stop_cluster)
