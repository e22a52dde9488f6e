"""A first DeepSpeed start, with DeepSpeed's C++ op not built yet in this environment, is start-up
work, not a stall: the imports and the JIT build outlast a 1-second timeout, the call waits for
them, and the runtime says it in one line as the build starts and one as it ends, with the
compiler's output in a log file the lines name (tests/test_rank_errors.py has the other
errors).

Nothing is compiled twice: ``make ops`` built the op once for the environment
(gas_lab/runtime/ops.py). The test starts from a copy of that build in a cache of its own with
the op's library removed, so the start runs PyTorch's real JIT build (the lock, ninja, the
loader) and ninja has only the link left to do. A ninja that waits 2 s before it starts stands in
for the compiler's minutes, so the lock is held long enough to be a build (a load holds it
well under a second, and the runtime says nothing of a load: calls.QUIET_LOAD_S). If the runtime stops saying the build, or takes the start for a stall, the
assertions fail as they did against a full build.
"""

import json
import os
import re
import shutil
import sys

import pytest

from gas_lab.runtime import build_lock
from gas_lab.runtime.lifetime import run_command

pytestmark = pytest.mark.ranks


_COLD_START = """
import json, os, sys, time
os.environ["TORCH_EXTENSIONS_DIR"] = sys.argv[1]  # the op is not built here: DeepSpeed builds it
import gas_lab
from gas_lab.lessons import hello
c = gas_lab.start_cluster(world_size=2, device="cpu")
t = time.time()
out = c.run(hello.train_tiny_deepspeed, 1, timeout=1)
same = bool((out[0]["params"] == out[1]["params"]).all())
print(json.dumps({"seconds": time.time() - t, "same": same, "built": c.built}))
gas_lab.stop_cluster()
"""


OP = "deepspeed_shm_comm"


def unlinked_copy(cache) -> None:
    """``make ops``'s build of the op, copied into ``cache`` (times kept, so ninja sees the object
    files up to date) without the library itself: the next start builds it, by linking only."""
    built = os.path.join(build_lock.extensions_root(), OP)
    assert os.path.exists(os.path.join(built, f"{OP}.so")), (
        f"DeepSpeed's op {OP} is not built in {build_lock.extensions_root()}: run `make ops`"
    )
    shutil.copytree(built, cache / OP, ignore=shutil.ignore_patterns("lock", "gas_lab_build.log"))
    os.remove(cache / OP / f"{OP}.so")


def slow_ninja(folder, seconds: float = 2) -> dict:
    """The environment with a ``ninja`` first on PATH that waits, then runs the real one."""
    real = shutil.which("ninja") or os.path.join(os.path.dirname(sys.executable), "ninja")
    folder.mkdir()
    script = folder / "ninja"
    script.write_text(f'#!/bin/sh\n[ "$1" = --version ] || sleep {seconds}\nexec {real} "$@"\n')
    script.chmod(0o755)
    return {"PATH": f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"}


def test_a_first_deepspeed_start_is_start_up_work_not_a_stall(tmp_path):
    """Imports and the JIT build of DeepSpeed's op outlast a short timeout: not a stall."""
    cache = tmp_path / "cache"
    unlinked_copy(cache)
    objects = {p.name: p.stat().st_mtime_ns for p in (cache / OP).glob("*.o")}
    proc = run_command(
        [sys.executable, "-c", _COLD_START, str(cache)],
        timeout=900,
        env=os.environ | {"DS_ACCELERATOR": "cpu"} | slow_ninja(tmp_path / "bin"),
    )
    # The head says what gas_lab decided (start-up work, stall, death); the tail where it ended.
    assert proc.returncode == 0, proc.stderr[:3000] + "\n...\n" + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["same"] and result["seconds"] > 1
    assert list(result["built"]) == ["deepspeed_shm_comm"]  # said once, by the runtime
    # One line as the build starts, one as it ends, naming the log; not the compiler's lines.
    building = re.search(
        r"^gas_lab notice: building DeepSpeed's C\+\+ op deepspeed_shm_comm, once for this "
        r"environment: \d+ s \(the compiler's output goes to (\S+)\)$",
        proc.stderr,
        re.M,
    )
    assert building, proc.stderr[:3000]
    log = building[1]
    assert re.search(
        r"^gas_lab notice: built DeepSpeed's C\+\+ op deepspeed_shm_comm in \d+ s, once for this "
        rf"environment: it is kept in {re.escape(str(cache))}; full log: {re.escape(log)}$",
        proc.stderr,
        re.M,
    ), proc.stderr[-3000:]
    with open(log) as f:
        logged = f.read()
    # What the ranks printed while they built, and the compiler's commands (PyTorch shows their
    # output only when a build fails): none of it in the cell.
    assert "--- what the ranks printed during the build ---" in logged
    assert "command = $cxx -MMD" in logged and "$cxx" not in proc.stdout + proc.stderr
    assert "built successfully" not in proc.stdout + proc.stderr
    # a word, not a substring: DeepSpeed's and the compiler's lines may say "installed"
    assert not re.search(r"\bstalled\b", proc.stderr)
    assert os.path.exists(cache / OP / f"{OP}.so")  # built again, by the start
    assert objects and {p.name: p.stat().st_mtime_ns for p in (cache / OP).glob("*.o")} == objects
    print(f"cold DeepSpeed start with timeout=1: {result['seconds']:.1f} s")


def test_a_start_that_loads_the_built_op_says_nothing_of_a_build(tmp_path):
    """Every first load takes the op's lock for ninja's check: new ranks loading what `make ops`
    built see a lock come and go, and the runtime must not call that a build. (Ninja's check
    made to last half a second here, so the runtime, which looks 4 times a second, sees it.)"""
    _built = os.path.join(build_lock.extensions_root(), OP, f"{OP}.so")
    assert os.path.exists(_built), "run `make ops`"
    proc = run_command(
        [sys.executable, "-c", _COLD_START, build_lock.extensions_root()],
        timeout=600,
        env=os.environ | {"DS_ACCELERATOR": "cpu"} | slow_ninja(tmp_path / "bin", 0.5),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["same"] and result["built"] == {}
    # On a loaded machine the load itself can outlast the call's 1 s: it may be said as loading,
    # never as a build.
    assert not re.search(r"\bbuil(d|t|ding)\b", proc.stderr), proc.stderr[-3000:]
