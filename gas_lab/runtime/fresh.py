"""Fresh rank processes in a fraction of a second: one process imports torch and DeepSpeed once,
then forks a new set of ranks for every run (appendix A3's cases, the tests that need ranks
nobody has used before).

A case that can crash a rank, abort it from inside gloo or leave it waiting in a collective
needs ranks of its own, bounded in time. Started as new interpreters, each rank pays the torch
and DeepSpeed imports again (seconds per rank, more on a loaded machine). Here a *forker*
process (:func:`_serve`) imports them once and waits for requests; for each
:func:`run` it forks a *leader* in a session of its own, which sets ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` the way ``torchrun`` does and forks the
ranks. Each rank calls ``module:function(*args)``, writes what it prints (faulthandler and C++
aborts included) to ``log<rank>.txt`` in the run's folder, and exits with the code and the
traceback a fresh interpreter would give, without its teardown; the leader notes each rank's exit
code in ``exit<rank>.txt``.
At the timeout the leader's whole session is killed. The forker ends with the process that
started it (its stdin closes). Linux only: elsewhere each rank is a new interpreter.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

# The slow imports every rank needs, imported once by the forker before any fork. The last two
# are imported lazily by the first torch optimizer (torch._dynamo) and by the first
# deepspeed.initialize (its ZeRO check imports Muon, which compiles): 3 CPU seconds in every
# rank that did not inherit them. The cluster's ranks inherit them too, on CPU ranks
# (rank_process.py).
RANK_IMPORTS = (
    "torch",
    "torch.distributed",
    "deepspeed",
    "torch._dynamo",
    "deepspeed.runtime.zero.muon.muon_optimizer",
)
_FORK = sys.platform == "linux"
_forkers: dict[tuple, subprocess.Popen] = {}


def free_port() -> int:
    """A TCP port that is free on loopback right now (a ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(
    target: str,
    args: list,
    folder: str | os.PathLike,
    world_size: int = 2,
    timeout: float = 90.0,
    env: dict | None = None,
) -> dict:
    """Run ``target`` (``"package.module:function"``) with ``args`` (JSON data) on
    ``world_size`` fresh ranks; their logs go to ``folder``. Returns ``seconds``, ``timed_out``
    and ``exit_codes`` (one per rank: negative for a signal, None when unknown)."""
    folder = Path(folder)
    env = {
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        **(env or {}),
    }
    request = {"target": target, "args": args, "world_size": world_size, "env": env}
    request.update(folder=str(folder), path=sys.path)  # the caller's modules, importable
    start = time.perf_counter()
    timed_out = (_forked if _FORK else _spawned)(request, start + timeout)
    codes = []
    for rank in range(world_size):
        try:
            codes.append(int((folder / f"exit{rank}.txt").read_text()))
        except (OSError, ValueError):
            codes.append(None)
    return {"seconds": time.perf_counter() - start, "timed_out": timed_out, "exit_codes": codes}


def _forker(env: dict) -> subprocess.Popen:
    """The forker for this environment (what the imports see), started once."""
    from gas_lab.runtime.lifetime import _die_with_parent

    key = tuple(sorted((k, env.get(k)) for k in ("DS_ACCELERATOR", "OMP_NUM_THREADS")))
    proc = _forkers.get(key)
    if proc is None or proc.poll() is not None:
        proc = _forkers[key] = subprocess.Popen(
            # -c, not -m: importing gas_lab imports this module, which -m would then run again.
            [sys.executable, "-c", "from gas_lab.runtime.fresh import _serve; _serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **dict((k, v) for k, v in key if v is not None)},
            preexec_fn=_die_with_parent,
        )
    return proc


def _forked(request: dict, deadline: float) -> bool:
    """One run through the forker; True if it ran out of time and its session was killed."""
    proc = _forker(request["env"])
    proc.stdin.write(json.dumps(request) + "\n")
    proc.stdin.flush()
    leader = _line(proc, deadline + 60)  # the forker may still be importing
    if not leader.isdigit():
        raise RuntimeError(f"the process that forks fresh ranks ended: {leader!r}")
    done = _line(proc, deadline)
    if done:
        return False
    try:
        os.killpg(int(leader), signal.SIGKILL)  # the leader and every rank it forked
    except OSError:
        pass
    _line(proc, time.perf_counter() + 30)  # the forker saw its leader end
    return True


def _line(proc: subprocess.Popen, deadline: float) -> str:
    """The forker's next line, or "" if none came before ``deadline``."""
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            return ""
        ready, _, _ = select.select([proc.stdout], [], [], min(left, 1.0))
        if ready:
            return proc.stdout.readline().strip() or "(no answer)"


def _spawned(request: dict, deadline: float) -> bool:
    """Elsewhere than Linux: each rank a new interpreter, each in a session of its own."""
    procs = []
    for rank in range(request["world_size"]):
        code = "import json, sys; from gas_lab.runtime.fresh import _rank; _rank(json.loads(sys.argv[1]), int(sys.argv[2]))"
        env = {**os.environ, **request["env"]}
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code, json.dumps(request), str(rank)],
                env=env,
                start_new_session=True,
            )
        )
    timed_out = False
    for rank, p in enumerate(procs):
        try:
            p.wait(timeout=max(deadline - time.perf_counter(), 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
            p.kill()
            p.wait()
        Path(request["folder"], f"exit{rank}.txt").write_text(str(p.returncode))
    return timed_out


def _rank(request: dict, rank: int) -> None:
    """A rank: its output to its log, the torchrun variables, then the target; it exits as the
    interpreter would report it (an exception: a traceback in its log and exit code 1)."""
    import importlib

    log = os.open(Path(request["folder"]) / f"log{rank}.txt", os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the forker's requests are not the rank's
    os.environ.update(request["env"], RANK=str(rank), LOCAL_RANK=str(rank))
    sys.path[:] = request["path"]
    module, _, name = request["target"].partition(":")
    code = 0
    try:
        getattr(importlib.import_module(module), name)(*request["args"])
    except SystemExit as ended:  # as the interpreter reports it: an int is the code, else printed
        if isinstance(ended.code, int) or ended.code is None:
            code = ended.code or 0
        else:
            print(ended.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    # No interpreter teardown: with torch and DeepSpeed loaded it takes 0.5 to 1.5 s per rank,
    # and a rank waiting on a failed peer waits it out before its connection is closed (or reset,
    # when the peer's data was never read). Leaving the process group first can wait too.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _lead(request: dict) -> None:
    """The leader, in a session of its own: fork the ranks, note how each ended, exit."""
    os.setsid()
    pids = {}
    for rank in range(request["world_size"]):
        pid = os.fork()
        if pid == 0:
            _rank(request, rank)  # never returns: the rank ends in os._exit with its code
        pids[pid] = rank
    while pids:
        pid, status = os.wait()
        rank = pids.pop(pid)
        Path(request["folder"], f"exit{rank}.txt").write_text(
            str(os.waitstatus_to_exitcode(status))
        )
    os._exit(0)


def preload() -> None:
    """Import :data:`RANK_IMPORTS` in this process, before it forks ranks."""
    import importlib

    for name in RANK_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # a run that needs it fails in its own log


def _serve() -> None:
    """The forker: import once, then one leader per request line, until stdin closes."""

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # an interrupt is for the notebook's own work
    # The answers get a pipe of their own; what the imports print (DeepSpeed logs to stdout
    # when DS_ACCELERATOR is unset) goes to stderr, not into the answers.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    preload()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _lead(request)  # never returns
        print(pid, file=answers)
        os.waitpid(pid, 0)
        print("done", file=answers)
