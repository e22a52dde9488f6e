"""DeepSpeed's C++ ops: the environment's own build cache, which ops a call built, and stale
build locks, the one DeepSpeed start-up hang a learner cannot see the cause of.

DeepSpeed builds its C++ ops on first use with PyTorch's JIT extension loader, in
``TORCH_EXTENSIONS_DIR`` (else ``~/.cache/torch_extensions/<python>_<device>/``, shared by every
environment of the user: each rebuilds over the others, since an op's build file records the
environment's paths). Importing gas_lab points it at the environment's own folder,
``<sys.prefix>/torch_extensions`` (:func:`use_environment_cache`), as ``make`` does for
everything it runs.

PyTorch guards each op's build folder with a lock file, ``<cache>/<op>/lock``: every process
that loads the op takes it at its first load, built or not (to run ninja, which rebuilds only
what changed), keeps it open while ninja and the compiler run in that folder, and removes it when
done; every other process waits while it exists. A process that ends while it holds the lock (a
stalled rank the runtime ended, an interrupt, a kernel restart during a build or a load) never
removes it, and every later start waits forever. :func:`left_by` says which of these the folder
shows.

A lock is *stale* when no process has it open and no process (ninja, the compiler) works in its
folder. Checked twice, a moment apart, that is proof: a holder keeps the file open from the
moment it exists until just before it removes it. :func:`clear_stale_locks` removes only those.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import time

import psutil

from gas_lab.runtime.rank_state import COMPILERS


def use_environment_cache() -> None:
    """Unless ``TORCH_EXTENSIONS_DIR`` is set, build DeepSpeed's ops in this environment's own
    folder (where the environment can be written: a venv or a conda env, not a system Python).
    PyTorch runs ``ninja`` from PATH at every load of an op, built or not: where PATH has none,
    the environment's own (pip's ``ninja`` package, beside this interpreter) is put first."""
    if not os.environ.get("TORCH_EXTENSIONS_DIR") and os.access(sys.prefix, os.W_OK):
        os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(sys.prefix, "torch_extensions")
    here = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and os.path.exists(os.path.join(here, "ninja")):
        os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")


def extensions_root() -> str:
    """Where PyTorch builds its JIT extensions (``TORCH_EXTENSIONS_DIR`` or the user cache)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return root
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "torch_extensions")


def built_ops(root: str | None = None) -> dict[str, int]:
    """Each op library in the cache, with the time it was last written (ns)."""
    root = root or extensions_root()
    found = glob.glob(os.path.join(root, "*", "*.so")) + glob.glob(f"{root}/*/*/*.so")
    stamps = {}
    for path in found:
        try:
            stamps[path] = os.stat(path).st_mtime_ns
        except OSError:
            continue
    return stamps


def builds_since(before: dict[str, int]) -> dict[str, float]:
    """The ops built since ``before`` (:func:`built_ops`), with ninja's seconds for each build."""
    built = {}
    for path, stamp in built_ops().items():
        if before.get(path) != stamp:
            built[os.path.basename(path).removesuffix(".so")] = _ninja_seconds(path)
    return built


def _ninja_seconds(library: str) -> float:
    """How long ninja's last build of ``library`` took (its log: start and end ms per target)."""
    try:  # lines: start, end, mtime, target, hash
        with open(os.path.join(os.path.dirname(library), ".ninja_log")) as f:
            rows = [ln.split("\t") for ln in f if not ln.startswith("#")]
        ends = [int(row[1]) for row in rows if row[3] == os.path.basename(library)]
        return ends[-1] / 1000  # the link is last: it ends when the build does
    except (OSError, IndexError, ValueError):
        return float("nan")


def compiling(folder: str) -> bool:
    """Whether an op's build is compiling or linking now: its library is missing, or a compiler
    runs in its folder (PyTorch runs ninja there; a load runs ninja alone, to check)."""
    if not glob.glob(os.path.join(folder, "*.so")):
        return True
    for proc in psutil.process_iter(["name", "cwd"]):
        if proc.info["name"] in COMPILERS and proc.info["cwd"] == folder:
            return True
    return False


def locks(root: str | None = None) -> list[str]:
    """Every build lock that exists now, held or not."""
    root = root or extensions_root()
    return sorted(glob.glob(os.path.join(root, "*", "*", "lock")) + glob.glob(f"{root}/*/lock"))


def holders(lock: str) -> list[psutil.Process]:
    """Processes that have ``lock`` open or work in its folder (a live build)."""
    lock, folder = os.path.realpath(lock), os.path.realpath(os.path.dirname(lock))
    found = []
    for p in psutil.process_iter():
        try:
            if p.cwd() == folder or any(f.path == lock for f in p.open_files()):
                found.append(p)
        except psutil.Error:
            continue  # gone, or another user's process (which cannot write our cache)
    return found


def stale_locks(root: str | None = None, recheck_after: float = 0.5) -> list[str]:
    """Locks that no process holds, seen twice ``recheck_after`` seconds apart."""
    first = [lock for lock in locks(root) if not holders(lock)]
    if not first:
        return []
    time.sleep(recheck_after)
    return [lock for lock in first if os.path.exists(lock) and not holders(lock)]


def age_text(path: str) -> str:
    try:
        minutes = (time.time() - os.path.getmtime(path)) / 60
    except OSError:
        return "gone now"
    return f"{minutes:.0f} min old" if minutes >= 1 else "less than a minute old"


def clear_stale_locks(root: str | None = None, say=None) -> list[str]:
    """Remove the stale build locks (see the module docstring) and say which (a runtime notice,
    unless ``say`` is given); return them."""
    if say is None:
        from gas_lab.runtime.notices import notice as say
    removed = []
    for lock in stale_locks(root):
        age, said = age_text(lock), left_by(lock)
        try:
            os.remove(lock)
        except FileNotFoundError:
            continue
        except OSError as exc:
            say(f"a stale build lock blocks DeepSpeed: delete it by hand: {lock} ({exc})")
            continue
        removed.append(lock)
        say(f"removed a stale build lock ({age}; no process held it), {said}: {lock}")
    return removed


def left_by(lock: str) -> str:
    """What the lock's folder shows of the process that left it: PyTorch takes the lock at every
    first load of an op in a process, built or not, so a lock alone does not mean a build."""
    try:
        taken = os.path.getmtime(lock)
    except OSError:
        return "gone now"
    libraries = [
        os.path.getmtime(p) for p in glob.glob(os.path.join(os.path.dirname(lock), "*.so"))
    ]
    if not libraries:
        return "left by a process that ended before it had built the op (no library is there)"
    if max(libraries) >= taken:
        return "left by a process that ended after it had built the op, before it removed the lock"
    return (
        "left by a process that ended while it loaded the op, which was built already (PyTorch "
        "takes the lock at every first load, to check the build)"
    )
