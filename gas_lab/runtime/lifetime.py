"""Process lifetime: every process the runtime starts ends with the kernel that started it.

A kernel can end in many ways: a clean exit, Kernel -> Restart or Shut Down (a shutdown request,
then SIGTERM after 2.5 s, then SIGKILL to the kernel's process group after 5 s), a crash or the
out-of-memory killer. The ranks and the ipyparallel controller run in sessions of their own, so
none of the signals a kernel receives reaches them. Three layers make sure they end anyway:

* every process of a cluster carries ``GAS_LAB_CLUSTER=<cluster id>`` in its environment, and
  the cluster id names the kernel that owns it (pid and start time, so a reused pid is no owner);
* a small *guardian* process (this file run as a script, in a session of its own, so no signal
  sent to the kernel's group reaches it) waits for the kernel to end, however it ends, and then
  ends every process carrying the marker;
* :func:`end_orphans`, called by every ``start_cluster``, ends what an earlier kernel left
  behind if its guardian was killed too.

The ranks and their parent also watch the kernel themselves, each second, and end once it is
gone (on_rank.py, rank_process.py).

ipyparallel's own ``Cluster`` ends its processes on a clean shutdown only: started in a kernel
that is then shut down "now" (or killed), all 13 of its processes (controller and schedulers, 2
engines, 2 nannies) were still running 5 s later (measured, ipyparallel 9.2).

This module imports only the standard library and psutil: the guardian runs it as a script.
"""

from __future__ import annotations

import glob
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil

MARKER = "GAS_LAB_CLUSTER"
TMP_PREFIX = "gas_lab_ranks_"
_ID = re.compile(r"^gas_lab-(\d+)-(\d+)-")


def new_cluster_id(port: int) -> str:
    """An id naming the owning process: ``gas_lab-<pid>-<start time in ms>-<port>``."""
    me = psutil.Process()
    return f"gas_lab-{me.pid}-{_born_ms(me)}-{port}"


def _born_ms(p: psutil.Process) -> int:
    """When ``p`` started, in ms. On Linux, counted from boot: psutil's wall-clock start time
    moves when the clock is set (NTP on a freshly booted machine, a laptop waking up), and a
    moved start time would make a live owner look gone, and its ranks end."""
    try:
        with open(f"/proc/{p.pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        return ticks * 1000 // os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return int(p.create_time() * 1000)


def owner_alive(cluster_id: str) -> bool:
    """Is the process that started this cluster still running (the same process, not a reuse)?"""
    m = _ID.match(cluster_id)
    if m is None:
        return True  # not ours to judge
    pid, born_ms = int(m[1]), int(m[2])
    try:
        p = psutil.Process(pid)
        return abs(_born_ms(p) - born_ms) < 1000 and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _marked() -> dict[str, list[psutil.Process]]:
    """Processes of this user that carry a cluster marker, by cluster id."""
    found: dict[str, list[psutil.Process]] = {}
    for p in psutil.process_iter():
        try:
            cid = p.environ().get(MARKER)
        except psutil.Error:
            continue  # gone, or another user's process
        if cid:
            found.setdefault(cid, []).append(p)
    return found


def end_processes(procs: list[psutil.Process], timeout: float = 5.0) -> None:
    """SIGKILL ``procs`` and their descendants; wait until each is gone or a zombie.

    Children go first, while their parents live to collect them: the ranks are collected at
    once by the process that forked them (rank_process.py). Killed together with it, they would
    wait as zombies for the system's init, which took about 2 s in a container."""
    everyone = {}
    for p in procs:
        try:
            for q in [p, *p.children(recursive=True)]:
                everyone[q.pid] = q
        except psutil.Error:
            pass
    children = [p for p in everyone.values() if _parent(p) in everyone]
    _kill(children)
    psutil.wait_procs(children, timeout=0.5)  # gone, not only dead: collected
    _kill([p for p in everyone.values() if p not in children])
    deadline = time.monotonic() + timeout
    waiting = list(everyone.values())
    while waiting and time.monotonic() < deadline:
        _, waiting = psutil.wait_procs(waiting, timeout=0.05)  # reaps our own children
        waiting = [p for p in waiting if running(p)]


def _parent(p: psutil.Process) -> int | None:
    try:
        return p.ppid()
    except psutil.Error:
        return None


def _kill(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def running(p: psutil.Process | int | None) -> bool:
    """Whether process ``p`` (or pid) still runs: not gone, and not a zombie, an ended process
    that waits for its parent to collect it."""
    try:
        if not isinstance(p, psutil.Process):
            p = psutil.Process(p)
        return p.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, ValueError, TypeError):  # gone; or no pid at all (None)
        return False


def end_cluster(cluster_id: str, tmp: str | None, pids: list[int] = ()) -> None:
    """End every process of one cluster (marked, or listed in ``pids``) and remove its folder."""
    procs = _marked().get(cluster_id, [])
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass
    end_processes(procs)
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)


def end_orphans() -> int:
    """End the processes and remove the folders of clusters whose kernel is gone; return how many
    processes were ended. Clusters of running kernels (another notebook's) are left alone."""
    ended = 0
    for cid, procs in _marked().items():
        if cid.startswith("gas_lab-") and not owner_alive(cid):
            end_processes(procs)
            ended += len(procs)
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), TMP_PREFIX + "*")):
        cid = _read(folder, "cluster_id")
        if cid is not None and not owner_alive(cid):
            shutil.rmtree(folder, ignore_errors=True)
    return ended


def other_clusters() -> list[dict]:
    """The clusters other running kernels started on this machine (another notebook's ranks):
    ``id``, ``folder``, ``notebook`` (its name, when Jupyter told the kernel), ``processes``
    and ``mb`` (:func:`memory_mb`). Each cluster's folder names its owner (``cluster_id``)."""
    marked, found, mine = _marked(), [], f"gas_lab-{os.getpid()}-"
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), TMP_PREFIX + "*")):
        cid, notebook = (_read(folder, name) for name in ("cluster_id", "notebook"))
        procs = [p for p in marked.get(cid, []) if running(p)]
        if cid is None or cid.startswith(mine) or not procs or not owner_alive(cid):
            continue
        name = notebook or f"the kernel with pid {_ID.match(cid)[1]}"
        found.append(
            dict(id=cid, folder=folder, notebook=name, processes=len(procs), mb=memory_mb(procs))
        )
    return found


def cluster_processes(cluster_id: str) -> list[psutil.Process]:
    """The running processes that carry ``cluster_id``'s marker."""
    return [p for p in _marked().get(cluster_id, []) if running(p)]


def memory_mb(procs) -> float:
    """The memory ``procs`` hold together, in MB, each shared page counted once: the sum of
    their PSS (a page shared by n processes counts 1/n in each). The ranks are forked from one
    process and share most pages, so a sum of RSS counts those pages once per process (756 MB
    for ranks whose PSS was 306 MB). Where PSS is unknown (not Linux), USS, then RSS."""
    total = 0
    for p in procs:
        if p is None:
            continue
        try:
            full = p.memory_full_info()
            total += getattr(full, "pss", None) or getattr(full, "uss", None) or full.rss
        except psutil.AccessDenied:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        except psutil.Error:
            pass
    return total / 2**20


def _read(folder: str, name: str) -> str | None:
    try:
        with open(os.path.join(folder, name)) as f:
            return f.read().strip()
    except OSError:
        return None


def start_guardian(cluster_id: str, tmp: str) -> subprocess.Popen:
    """Start the guardian of one cluster. Close its stdin (or end this process) to make it act."""
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), cluster_id, tmp],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # out of reach of the signals sent to the kernel's group
        env={k: v for k, v in os.environ.items() if k != MARKER},
    )


def stop_guardian(guardian: subprocess.Popen | None) -> None:
    if guardian is None:
        return
    try:
        guardian.stdin.close()  # end of file: the guardian ends what is left, and exits
        if os.name != "posix":
            guardian.terminate()  # it cannot watch the pipe there
        guardian.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        guardian.kill()


def _guard(cluster_id: str, tmp: str) -> None:
    """The guardian: wait until the owner is gone, then end its cluster.

    End of file on stdin means the owner closed it or died; polling the owner as well covers an
    owner whose forked children still hold the pipe open."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while owner_alive(cluster_id):
        if os.name != "posix":  # select() takes only sockets there: poll the owner alone
            time.sleep(0.25)
            continue
        readable, _, _ = select.select([sys.stdin], [], [], 0.25)
        if readable and not os.read(sys.stdin.fileno(), 4096):
            break
    end_cluster(cluster_id, tmp)


def _die_with_parent() -> None:
    """In a child, before exec: get SIGTERM when the parent ends (Linux; elsewhere nothing)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_command(args: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(args, capture_output=True, text=True, timeout=timeout)``, except that a
    timeout or an interrupt ends the whole process tree, not only the first process.

    A launcher such as ``torchrun`` starts its workers as children; killing only the launcher
    (what ``subprocess.run`` does on timeout) would leave the workers running for good. The
    command runs in a session of its own, gets SIGTERM if this process dies, and on timeout or
    interrupt gets SIGTERM (so a launcher can stop its workers), then its tree gets SIGKILL.
    """
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        **kwargs,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:  # TimeoutExpired, KeyboardInterrupt: the tree goes with it
        try:
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.Error:
            tree = []
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        end_processes(tree)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


if __name__ == "__main__":
    _guard(sys.argv[1], sys.argv[2])
