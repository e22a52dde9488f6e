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

Failures end the call instead of hanging it: an exception on a rank raises :class:`RankError`
naming that rank, with its traceback; a rank that does not finish in time (typically stuck
in a collective another rank never joined) raises :class:`RankStallError` naming it. In both
cases ranks that are still stuck are killed and fresh ones started, because a process group
with a half-finished collective cannot be trusted again; variables on the ranks are lost.
"""

from __future__ import annotations

import atexit
import inspect
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import time

from gas_lab.runtime.on_rank import call_on_rank, exec_on_rank, setup_rank
from gas_lab.runtime.rank_errors import RankError, RankStallError, error_text

DEFAULT_TIMEOUT = 60.0  # seconds a call may run before its unfinished ranks count as stalled
# Harmless lines DeepSpeed prints on a CPU-only machine while probing optional features
# (async I/O needs libaio; a deprecation inside DeepSpeed), and its warning for the SGD the
# lessons allow on purpose (zero_allow_untested_optimizer). Hidden so real output stands out.
_NOISE = re.compile(
    r"cannot find -laio|collect2: error: ld returned|all_gather_into_tensor` is deprecated"
    r"|^\s+return func\(\*args, \*\*kwargs\)$|\[WARNING\].*untested optimizer"
)
ERROR_GRACE = 5.0  # after one rank fails, how long the others get to finish before we stop waiting


def _free_port() -> int:
    """A TCP port that is free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_world_size() -> tuple[int, str]:
    """One rank per GPU with nccl where GPUs exist, else 2 CPU ranks with gloo."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return torch.cuda.device_count(), "nccl"
    except ImportError:
        pass
    return 2, "gloo"


def _source_of(fn) -> tuple[list[str], int] | None:
    try:
        lines, first = inspect.getsourcelines(fn)
        return lines, max(first, 1)
    except (OSError, TypeError):
        return None


def _ship_module_by_value(fn) -> None:
    """Functions from a test file or a script beside the notebook are not importable on the
    ranks, so send their module's code along instead of a reference to it."""
    import sysconfig

    import cloudpickle

    if not callable(fn):
        return
    mod = sys.modules.get(getattr(fn, "__module__", None) or "")
    path = getattr(mod, "__file__", None)
    if mod is None or path is None or mod.__name__ == "__main__":
        return
    roots = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib")}
    roots.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # gas_lab/ itself
    if not any(os.path.abspath(path).startswith(r) for r in roots):
        cloudpickle.register_pickle_by_value(mod)


class Cluster:
    """A set of persistent rank processes. Use :func:`start_cluster` to get one."""

    def __init__(self, world_size: int, backend: str, pg_timeout: float = 120.0):
        self.world_size, self.backend, self.pg_timeout = world_size, backend, pg_timeout
        self._ipp = self._client = None
        self.pids: list[int] = []
        self.startup_seconds = 0.0

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> Cluster:
        import ipyparallel as ipp

        t0 = time.perf_counter()
        self._tmp = tempfile.mkdtemp(prefix="gas_lab_ranks_")
        self.master_port = _free_port()
        env = {
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.master_port),
            # Share the cores instead of every rank spawning one thread per core.
            "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // self.world_size)),
            "PYTHONUNBUFFERED": "1",
        }
        if self.backend == "gloo":
            # CPU ranks even on a GPU machine: hide the GPUs so every layer agrees.
            env.update(DS_ACCELERATOR="cpu", GLOO_SOCKET_IFNAME="lo", CUDA_VISIBLE_DEVICES="")
        self._ipp = ipp.Cluster(
            n=self.world_size,
            controller_ip="127.0.0.1",
            log_level=logging.ERROR,  # engines exit non-zero when stopped; that is not news
            cluster_id=f"gas_lab-{os.getpid()}-{self.master_port}",
        )
        self._ipp.start_controller_sync()
        self._ipp.start_engines_sync(self.world_size, environment=env)
        self._client = self._ipp.connect_client_sync()
        self._client.wait_for_engines(self.world_size, timeout=120, interactive=False)
        self._engines = sorted(self._client.ids)[: self.world_size]  # rank r -> engine id
        self._client[self._engines].use_cloudpickle()  # ship functions defined in the notebook
        store = os.path.join(self._tmp, "store")
        args = (store, self.pg_timeout)
        futures = [
            self._view(r).apply_async(call_on_rank, setup_rank, (r, *args), {}) for r in self.ranks
        ]
        infos = self._gather(futures, timeout=120, restart=False)
        self.pids = [i["pid"] for i in infos]
        self.startup_seconds = time.perf_counter() - t0
        return self

    def stop(self) -> None:
        """End every rank process and the controller. Safe to call twice."""
        if self._ipp is None:
            return
        # Ranks hold no state worth saving, and a rank stuck in a collective ignores a polite
        # stop, so end them outright; then the controller.
        _kill(self.pids)
        try:
            if self._client is not None:
                self._client.close()
            self._ipp.stop_cluster_sync()
        except Exception:
            pass
        self._ipp = self._client = None
        self.pids = []
        shutil.rmtree(self._tmp, ignore_errors=True)

    def restart(self) -> Cluster:
        self.stop()
        return self.start()

    @property
    def running(self) -> bool:
        import psutil

        return self._ipp is not None and all(psutil.pid_exists(p) for p in self.pids)

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

        What the ranks print is shown here, prefixed with the rank.
        """
        self._ensure_running()
        return self._gather(self._submit(fn, *args, **kwargs), timeout)

    def execute(self, code: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Run source code on every rank, in each rank's persistent namespace (``%%ranks``)."""
        self._ensure_running()
        self._gather(self._submit(exec_on_rank, code), timeout)

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
            _ship_module_by_value(obj)
        source = _source_of(fn)
        return [
            self._view(r).apply_async(call_on_rank, fn, args, kwargs, source) for r in self.ranks
        ]

    def _ensure_running(self) -> None:
        if not self.running:
            print(f"gas_lab: starting {self.world_size} ranks ...", file=sys.stderr)
            self.stop()
            self.start()

    def _gather(self, futures: list, timeout: float, restart: bool = True) -> list:
        """Wait for every rank; fail fast when one raised, and never wait past ``timeout``."""
        deadline, first_error = time.monotonic() + timeout, None

        def failed(f) -> bool:
            return f.ready() and (f.exception() is not None or f.get()[0] == "error")

        while not all(f.ready() for f in futures):
            now = time.monotonic()
            if first_error is None and any(failed(f) for f in futures):
                first_error = now
            if now > deadline or (first_error is not None and now - first_error > ERROR_GRACE):
                break
            time.sleep(0.02)
        self._print_outputs(futures)
        ranked = list(zip(self.ranks, futures, strict=True))
        stalled = [r for r, f in ranked if not f.ready()]
        errors = {r: error_text(f) for r, f in ranked if failed(f)}
        if stalled and restart:
            self.restart()  # a half-finished collective poisons the process group
        if errors:
            raise RankError(errors, stalled, restarted=bool(stalled) and restart)
        if stalled:
            raise RankStallError(stalled, [r for r in self.ranks if r not in stalled], timeout)
        return [f.get()[1] for f in futures]

    def _print_outputs(self, futures: list) -> None:
        for r, f in zip(self.ranks, futures, strict=True):
            for stream, out in (("stdout", sys.stdout), ("stderr", sys.stderr)):
                text = getattr(f, stream, "") or ""
                for line in text.rstrip("\n").splitlines() if text.strip() else []:
                    if _NOISE.search(line):
                        continue
                    print(f"[rank {r}] {line}", file=out)


def _kill(pids: list[int]) -> None:
    import psutil

    procs = [psutil.Process(p) for p in pids if psutil.pid_exists(p)]
    for p in procs:
        p.kill()
    psutil.wait_procs(procs, timeout=10)


_current: Cluster | None = None


def start_cluster(
    world_size: int | None = None, restart: bool = False, device: str | None = None
) -> Cluster:
    """Start the notebook's ranks, or return the ones already running.

    ``world_size=None`` means 2 CPU ranks (gloo, ``DS_ACCELERATOR=cpu``) on a machine without a
    GPU and one rank per GPU (nccl) otherwise. ``device="cpu"`` forces CPU ranks on a GPU
    machine (the course's tests do, so they check the same thing everywhere). Asking for a
    different world size or device, or ``restart=True``, stops the running ranks first, so
    processes never pile up.
    """
    global _current
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
    if _current is not None and _current.running and not restart:
        if (_current.world_size, _current.backend) == (world_size, backend):
            return _current
    if _current is not None:
        _current.stop()
    _current = Cluster(world_size, backend).start()
    _register_magic(_current)
    return _current


def stop_cluster() -> None:
    """Stop the running ranks, if any (also done automatically when the kernel exits)."""
    global _current
    if _current is not None:
        _current.stop()
        _current = None


atexit.register(stop_cluster)


def _register_magic(cluster: Cluster) -> None:
    """Register ``%%ranks [--timeout S]``: run the cell on every rank of ``cluster``."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is None:
        return

    def ranks(line: str, cell: str) -> None:
        parts = line.split()
        timeout = (
            float(parts[parts.index("--timeout") + 1]) if "--timeout" in parts else DEFAULT_TIMEOUT
        )
        (_current or cluster).execute(cell, timeout=timeout)

    ip.register_magic_function(ranks, magic_kind="cell", magic_name="ranks")
