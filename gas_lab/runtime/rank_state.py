"""What an unfinished rank is doing: waiting in a collective, or busy (importing, building, computing).

A rank that has not answered in time is either *stalled* (waiting in a collective that another
rank never joins: it will wait forever) or *busy* (importing DeepSpeed, building a C++ op on
first use, or computing: it will finish). Telling them apart needs the rank's Python stack,
even while the rank is blocked inside C++ (gloo waits there, holding no Python lock). Each
rank registers :mod:`faulthandler` on ``SIGUSR2`` at start-up, so a signal makes the
interpreter's C-level handler append the stack of the thread it interrupts to a file, whatever
the rank is doing. :func:`sample` sends it to the rank's main thread and reads the stack back.
(Only that thread's: a dump of every thread reads the others' frames while they run, and
crashed about 1 signal in 440 while threads started and ended, as DeepSpeed's start-up does.)
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import time
from dataclasses import dataclass

import psutil

STACK_SIGNAL = getattr(signal, "SIGUSR2", None)  # POSIX; elsewhere ranks cannot be sampled
_DUMP = "Stack (most recent call first):"  # what faulthandler writes above a thread's frames
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
COLLECTIVE_FILES = ("torch/distributed/distributed_c10d.py", "deepspeed/comm/")
BUILD_FILES = ("torch/utils/cpp_extension.py", "deepspeed/ops/op_builder/")
# ninja is not among them: PyTorch runs it at every first load of an op, built or not, to check
# the build; only a compiler or the linker under it means a build.
COMPILERS = {"cc1plus", "cc1", "c++", "g++", "gcc", "cc", "clang", "clang++", "ld", "collect2"}
# busy, and worth waiting for
STARTUP = {"importing", "building", "loading", "build_lock", "deepspeed_init"}


@dataclass
class RankState:
    kind: str  # collective, importing, building, build_lock, deepspeed_init, computing, unknown
    text: str  # for the learner: "waiting in a collective (all_reduce, called from f line 6)"
    frames: tuple = ()  # the main thread's stack, innermost first, as (file, line, function)

    @property
    def starting_up(self) -> bool:
        return self.kind in STARTUP


def is_user_code(path: str) -> bool:
    """The learner's code (the notebook, their files, gas_lab's lessons), not a library's."""
    if "site-packages" in path or path == "<string>" or path.startswith("<frozen"):
        return False
    if "gas_lab/runtime" in path:
        return False
    return path.startswith("<") or not path.startswith(os.path.dirname(os.__file__))


def _user_frame(frames: list[tuple[str, int, str]]) -> str:
    """The innermost frame of the learner's own code, as ``fn line N``."""
    return next(
        (f"{fn} line {line}" for path, line, fn in frames if is_user_code(path)), "the runtime"
    )


def classify(frames: list[tuple[str, int, str]], children: list[str], cpu: float) -> RankState:
    """``frames`` innermost first, as (file, line, function)."""
    state = _classify(frames, children, cpu)
    state.frames = tuple(frames)
    return state


def _classify(frames: list[tuple[str, int, str]], children: list[str], cpu: float) -> RankState:
    where = _user_frame(frames)
    if any(c in COMPILERS for c in children):
        return RankState("building", "building a C++ op for DeepSpeed (the compiler is running)")
    for path, _, fn in frames:
        if "torch/utils/file_baton.py" in path:
            return RankState("build_lock", "waiting for a C++ op build lock (torch_extensions)")
        if any(f in path for f in BUILD_FILES):  # no compiler: ninja checks a built op
            return RankState(
                "loading", "loading a C++ op for DeepSpeed (ninja checks that it is up to date)"
            )
        if any(f in path for f in COLLECTIVE_FILES) and not fn.startswith("_"):
            name = next((f for p, _, f in reversed(frames) if COLLECTIVE_FILES[0] in p), fn)
            return RankState("collective", f"waiting in a collective ({name}, called from {where})")
        if path.startswith("<frozen importlib"):
            module, caller = _imported(frames)
            return RankState("importing", f"importing {module} (from {caller})")
        if path.endswith("deepspeed/__init__.py") and fn == "initialize":
            return RankState("deepspeed_init", f"inside deepspeed.initialize (from {where})")
    return RankState("computing", f"computing in {where} ({cpu:.0f}% CPU)")


def _imported(frames) -> tuple[str, str]:
    """The outermost module being imported, and the learner's line that imports it."""
    outer_first = list(reversed(frames))
    first = next(i for i, (p, _, _) in enumerate(outer_first) if p.startswith("<frozen importlib"))
    caller = _user_frame(list(reversed(outer_first[:first])))
    for path, _, _ in outer_first[first:]:
        if not path.startswith("<"):
            if "site-packages/" in path:
                return path.split("site-packages/")[1].split("/")[0].removesuffix(".py"), caller
            name = os.path.basename(path).removesuffix(".py")
            return (os.path.basename(os.path.dirname(path)) if name == "__init__" else name), caller
    return "a module", caller


def dump_frames(dump: str) -> list[tuple[str, int, str]]:
    """The frames of the last stack in a faulthandler dump, innermost first."""
    body = dump.rsplit(_DUMP, 1)[1] if _DUMP in dump else ""
    return [(m[1], int(m[2]), m[3]) for m in map(_FRAME.match, body.splitlines()) if m]


def _signal_main_thread(pid: int, sig: int) -> None:
    """Send ``sig`` to the main thread of process ``pid`` (its thread id is the pid): ``kill``
    lets any thread take it, and the handler dumps the thread that does (Linux's glibc has
    ``tgkill``; elsewhere the kernel's choice, nearly always the main thread)."""
    try:
        if ctypes.CDLL(None, use_errno=True).tgkill(pid, pid, sig) == 0:
            return
    except (AttributeError, OSError):
        pass
    os.kill(pid, sig)


def sample(pid: int, stack_file: str, wait: float = 1.0) -> RankState:
    """Ask rank process ``pid`` for its stack and say what it is doing."""
    if STACK_SIGNAL is None:
        return RankState("unknown", "not sampled on this system")
    try:
        proc = psutil.Process(pid)
        cpu0, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
        start = os.path.getsize(stack_file)
        _signal_main_thread(pid, STACK_SIGNAL)
        frames = _read_stack(stack_file, start, wait)
        cpu = 100 * (sum(proc.cpu_times()[:2]) - cpu0) / max(time.monotonic() - t0, 1e-3)
    except (psutil.Error, OSError):
        return RankState("unknown", "not responding")
    if not frames:
        return RankState("unknown", "no stack received")
    return classify(frames, _children_names(proc), cpu)


def _read_stack(stack_file: str, start: int, wait: float) -> list:
    """The frames of the dump the rank appends after ``start``. The rank's signal handler writes
    it a line at a time, and on a loaded machine it can pause part-way: read once frames are
    there and the file has stopped growing."""
    deadline, size, still = time.monotonic() + wait, start, 0
    while True:
        time.sleep(0.05)
        new = os.path.getsize(stack_file)
        still, size = (still + 1 if new == size else 0), new
        done = time.monotonic() >= deadline
        if (size > start and still >= 2) or done:  # 0.1 s without a new line, or out of time
            with open(stack_file) as f:
                f.seek(start)
                frames = dump_frames(f.read())
            if frames or done:
                return frames


def _children_names(proc: psutil.Process) -> list[str]:
    """Names of the rank's descendants. A compiler started by a build exits at any moment,
    also between being listed and being asked its name: skip it then."""
    names = []
    for child in proc.children(recursive=True):
        try:
            names.append(child.name())
        except psutil.Error:
            continue
    return names
