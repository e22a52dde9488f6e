"""Stale build locks: the one DeepSpeed start-up hang a learner cannot see the cause of.

DeepSpeed builds its C++ ops on first use with PyTorch's JIT extension loader, which guards each
op's build folder with a lock file, ``~/.cache/torch_extensions/<python>_<device>/<op>/lock``:
the process that builds creates it, keeps it open while ninja and the compiler run in that
folder, and removes it when done; every other process waits while it exists. A build killed
part-way (a stalled rank the runtime ended, an interrupt, a kernel restart during the first run)
never removes it, and every later start waits forever.

A lock is *stale* when no process has it open and no process (ninja, the compiler) works in its
folder. Checked twice, a moment apart, that is proof: a holder keeps the file open from the
moment it exists until just before it removes it. :func:`clear_stale_locks` removes only those.
"""

from __future__ import annotations

import glob
import os
import time

import psutil


def extensions_root() -> str:
    """Where PyTorch builds its JIT extensions (``TORCH_EXTENSIONS_DIR`` or the user cache)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return root
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "torch_extensions")


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


def clear_stale_locks(root: str | None = None, say=print) -> list[str]:
    """Remove the stale build locks (see the module docstring) and say which; return them."""
    removed = []
    for lock in stale_locks(root):
        age = age_text(lock)
        try:
            os.remove(lock)
        except FileNotFoundError:
            continue
        except OSError as exc:
            say(f"gas_lab: a stale build lock blocks DeepSpeed: delete it by hand: {lock} ({exc})")
            continue
        removed.append(lock)
        say(
            f"gas_lab: removed a stale build lock ({age}; no process held it), left by a C++ "
            f"build that was killed part-way: {lock}"
        )
    return removed
