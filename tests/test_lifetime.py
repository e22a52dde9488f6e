"""Process lifetime (issue 14, part 1) without a kernel: a failed start, the sweep of what an
earlier kernel left, the guardian alone, and a script whose launcher times out."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from gas_lab.runtime import lifetime
from gas_lab.runtime.cluster import Cluster, RankError


def _marked(cluster_id: str) -> list[psutil.Process]:
    return [p for p in lifetime._marked().get(cluster_id, []) if lifetime.running(p)]


@pytest.mark.ranks
def test_a_failed_start_leaves_no_process_and_no_folder():
    c = Cluster(2, "gloo", pg_timeout="not a number")  # every rank fails to join the group
    with pytest.raises(RankError, match="rank 0 raised TypeError"):
        c.start()
    assert _marked(c.cluster_id) == [] and not os.path.exists(c._tmp)
    assert c._guardian is None


_ORPHANS = """
import gas_lab, json, sys
from gas_lab.runtime.watch import engine_launchers
c = gas_lab.start_cluster(world_size=2, device="cpu")
print(json.dumps({"id": c.cluster_id, "guardian": c._guardian.pid, "tmp": c._tmp, "ranks": c.pids,
                  "parent": engine_launchers(c._ipp)[0].pid}), flush=True)
sys.stdin.read()
"""


@pytest.mark.ranks
def test_a_new_start_ends_what_a_dead_kernel_and_its_guardian_left():
    """The last layer: kernel and guardian both killed; the ranks end themselves (and their parent
    with them), the sweep every start_cluster runs ends the controller and removes the folder."""
    import json

    proc = subprocess.Popen(
        [sys.executable, "-c", _ORPHANS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    info = json.loads(proc.stdout.readline())
    left = _marked(info["id"])
    assert len(left) == 5  # controller and heart monitor, 2 ranks and their parent (no guardian)
    os.kill(info["guardian"], signal.SIGKILL)
    proc.kill()
    proc.wait()
    time.sleep(3)  # each rank's own watch thread notices within a second, and their parent
    assert not {p.pid for p in _marked(info["id"])} & {*info["ranks"], info["parent"]}
    # The controller had no one to end it: the sweep every start_cluster runs does. (Under
    # `make test`'s workers, a start on another worker may have swept it already.)
    lifetime.end_orphans()
    assert _marked(info["id"]) == [] and not os.path.exists(info["tmp"])


def test_the_guardian_ends_marked_processes_when_its_owner_dies(tmp_path):
    """A stand-in owner starts the guardian and a marked sleeper, then is killed."""
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, subprocess, sys, time\n"
            "from gas_lab.runtime import lifetime\n"
            "cid = lifetime.new_cluster_id(1)\n"
            f"open({str(tmp_path / 'cluster_id')!r}, 'w').write(cid)\n"
            f"g = lifetime.start_guardian(cid, {str(tmp_path)!r})\n"
            "s = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],\n"
            "                     env=os.environ | {lifetime.MARKER: cid}, start_new_session=True)\n"
            "print(g.pid, s.pid, flush=True)\n"
            "time.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    guardian, sleeper = map(int, owner.stdout.readline().split())
    owner.kill()
    owner.wait()
    t0 = time.monotonic()
    while (
        psutil.pid_exists(sleeper) or psutil.pid_exists(guardian)
    ) and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    assert not psutil.pid_exists(sleeper) and not psutil.pid_exists(guardian)
    assert time.monotonic() - t0 < 3 and not tmp_path.exists()


_LAUNCHER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         start_new_session=True)  # what torchrun does with its workers
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(120)
"""


def test_a_timed_out_command_takes_its_children_with_it(tmp_path):
    pid_file = tmp_path / "child.pid"
    with pytest.raises(subprocess.TimeoutExpired):
        lifetime.run_command([sys.executable, "-c", _LAUNCHER, str(pid_file)], timeout=3)
    child = int(pid_file.read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie"


def test_run_command_returns_like_subprocess_run():
    done = lifetime.run_command([sys.executable, "-c", "print('hi')"], timeout=60)
    assert done.returncode == 0 and done.stdout == "hi\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="psutil's boot time: Linux")
def test_a_clock_step_does_not_make_a_live_owner_look_gone(monkeypatch):
    """psutil dates a process from the boot time, which moves when the clock is set (NTP on a
    fresh machine, a laptop waking up): the owner must still count as alive, or its ranks end."""
    import psutil._pslinux

    cluster_id, started = lifetime.new_cluster_id(1), psutil.Process().create_time()
    boot_time = psutil._pslinux.boot_time
    monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: boot_time() + 5.0)
    assert psutil.Process().create_time() == pytest.approx(started + 5.0)  # the clock was set
    assert lifetime.owner_alive(cluster_id)


def test_memory_counts_pages_the_ranks_share_once():
    """Forked processes share their parent's pages: their memory is the sum of PSS, not of RSS
    (which counted the shared pages once per process: 756 MB for ranks whose PSS was 306 MB)."""
    import psutil

    from gas_lab.runtime.lifetime import memory_mb

    code = (
        "import os, sys, time\n"
        "block = bytearray(os.urandom(1)) * (200 * 2**20)  # 200 MB, every page written\n"
        "for _ in range(3):\n"
        "    if os.fork() == 0:\n"
        "        break\n"
        "os.write(1, b'ready\\n')  # one line each, not interleaved\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(4):
            assert proc.stdout.readline() == "ready\n"
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children()]
        assert len(family) == 4
        rss = sum(p.memory_info().rss for p in family) / 2**20
        shared_once = memory_mb(family)
        assert rss > 4 * 200 and 200 < shared_once < 300, (rss, shared_once)
    finally:
        for p in psutil.Process(proc.pid).children():
            p.kill()
        proc.kill()
        proc.wait()
