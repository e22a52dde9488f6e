"""The notebook runtime: results, rank errors, stalls, idempotent start, no leaked processes."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

import gas_lab
from gas_lab.runtime.calls import ERROR_GRACE
from gas_lab.runtime.cluster import RankError, RankStallError
from gas_lab.runtime.lifetime import cluster_processes, run_command, running

pytestmark = pytest.mark.ranks


def _env_and_allreduce(offset):
    import os

    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
    return {k: os.environ[k] for k in keys} | {"sum": t.item(), "pid": os.getpid()}


def test_run_returns_per_rank_results_and_a_torchrun_environment(cluster):
    results = cluster.run(_env_and_allreduce, 10)
    assert [r["RANK"] for r in results] == ["0", "1"]
    assert [r["LOCAL_RANK"] for r in results] == ["0", "1"]
    assert {r["WORLD_SIZE"] for r in results} == {"2"} == {r["LOCAL_WORLD_SIZE"] for r in results}
    assert {r["MASTER_ADDR"] for r in results} == {"127.0.0.1"}
    assert len({r["MASTER_PORT"] for r in results}) == 1
    assert [r["sum"] for r in results] == [21.0, 21.0]  # (0 + 10) + (1 + 10) on every rank
    assert [r["pid"] for r in results] == cluster.pids


def test_start_is_idempotent(cluster):
    again = gas_lab.start_cluster(device="cpu")
    assert again is cluster and again.pids == cluster.pids


def _fail_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")
    return dist.get_rank()


def test_an_exception_names_the_rank_and_shows_its_traceback(cluster):
    with pytest.raises(RankError) as info:
        cluster.run(_fail_on_rank_one)
    msg = str(info.value)
    assert "rank 1 raised ValueError: rank one is unhappy" in msg
    assert "_fail_on_rank_one" in msg and 'raise ValueError("rank one is unhappy")' in msg
    assert info.value.stalled == []  # rank 0 finished, so no restart was needed
    assert cluster.run(_env_and_allreduce, 0)[0]["sum"] == 1.0  # ranks still usable


def _fail_before_collective():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("died before the all_reduce")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a partner that never comes


def test_a_failed_rank_does_not_leave_the_others_hanging(cluster):
    old, kept = list(cluster.pids), _controller_and_parent(cluster)
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        cluster.run(_fail_before_collective, timeout=60)
    elapsed = time.monotonic() - t0
    assert "rank 1 raised RuntimeError: died before the all_reduce" in str(info.value)
    assert info.value.stalled == [0] and "restarted" in str(info.value)
    assert elapsed < 45, f"took {elapsed:.1f} s: the error should not wait for the full timeout"
    # rank 0 was seen waiting in the all_reduce rank 1 never joins: the call did not wait out
    # the grace the others get to finish (the restart's own seconds aside)
    waited = elapsed - cluster.startup_seconds
    assert waited < ERROR_GRACE, f"{waited:.1f} s before the restart"
    assert not any(psutil.pid_exists(p) for p in old)
    # only the ranks were restarted: the same parent forked new ones, the same controller, and
    # nothing of the old ranks is left (controller and heart monitor, parent, 2 ranks)
    assert _controller_and_parent(cluster) == kept and set(cluster.pids).isdisjoint(old)
    assert len(cluster_processes(cluster.cluster_id)) == 5
    assert cluster.run(_env_and_allreduce, 0)[1]["sum"] == 1.0


def test_without_the_ranks_parent_a_restart_starts_everything_anew(cluster):
    """The parent gone (killed, say, by the out-of-memory killer): a failed call still ends with
    working ranks, started anew with their own controller, not after a long wait."""
    controller, parent = _controller_and_parent(cluster)
    os.kill(parent, signal.SIGKILL)  # the ranks it forked run on, until the restart
    t0 = time.monotonic()
    with pytest.raises(RankError):
        cluster.run(_fail_before_collective, timeout=60)
    assert time.monotonic() - t0 < 30
    now = _controller_and_parent(cluster)
    assert now[0] != controller and now[1] != parent and not running(parent)
    assert cluster.run(_env_and_allreduce, 0)[1]["sum"] == 1.0


def _controller_and_parent(cluster) -> tuple[int, int]:
    from gas_lab.runtime.watch import engine_launchers

    return cluster._ipp.controller.pid, engine_launchers(cluster._ipp)[0].pid


def _stall_on_rank_zero():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    return "done"


def test_a_stall_ends_within_the_timeout_and_names_the_stalled_rank(cluster):
    old = list(cluster.pids)
    t0 = time.monotonic()
    with pytest.raises(RankStallError) as info:
        cluster.run(_stall_on_rank_zero, timeout=3)
    waited = time.monotonic() - t0
    assert info.value.stalled == [0] and info.value.finished == [1]
    assert "ranks [0] stalled" in str(info.value)
    assert waited < 3 + 40  # the timeout, plus killing and restarting the ranks
    assert not any(psutil.pid_exists(p) for p in old)
    assert cluster.running and cluster.run(_env_and_allreduce, 1)[0]["sum"] == 3.0


def test_cells_keep_state_on_each_rank(cluster, capsys):
    cluster.execute("import torch.distributed as dist\nmine = 100 + dist.get_rank()\nprint(mine)")
    assert cluster.pull("mine") == [100, 101]
    out = capsys.readouterr().out
    assert "[rank 0] 100" in out and "[rank 1] 101" in out
    with pytest.raises(RankError) as info:
        cluster.execute("x = 1\nraise KeyError('missing')")
    assert "raise KeyError('missing')" in str(info.value)  # the cell's own line, not ours


def test_a_cells_value_outside_a_notebook_is_printed_per_rank(cluster, capsys):
    """A plain script (gas_lab.check, a test) has no display: each rank's Out is a printed line."""
    cluster.execute("import torch.distributed as dist\n[dist.get_rank()] * 2", cell="In[4]")
    assert capsys.readouterr().out.splitlines()[-2:] == [
        "[rank 0] Out[4]: [0, 0]",
        "[rank 1] Out[4]: [1, 1]",
    ]
    cluster.execute("dist.get_rank();", ranks=[1])  # ; silences it, as in IPython
    cluster.execute("x = dist.get_rank()\nx", ranks=[1])
    assert capsys.readouterr().out.splitlines() == ["[rank 1] Out: 1"]


def _renamed_collectives():
    import torch
    import torch.distributed as dist

    gathered, shard = torch.empty(2), torch.empty(1)
    dist.all_gather_into_tensor(gathered, torch.ones(1))  # names torch 2.13 deprecated, which
    dist.reduce_scatter_tensor(shard, torch.ones(2))  # DeepSpeed 0.19.8 calls
    return gathered.tolist() + shard.tolist()


def test_ranks_do_not_warn_about_collectives_deepspeed_calls_by_their_old_names(cluster, capsys):
    assert cluster.run(_renamed_collectives) == [[1.0, 1.0, 2.0]] * 2
    assert "deprecated" not in capsys.readouterr().err


def test_the_ranks_say_built_only_when_a_build_ran(cluster, capsys):
    """DeepSpeed prints "... built successfully" whenever it loads its op; the runtime says
    "built" when the ranks really built one (the first call here, in a fresh environment)."""
    from gas_lab.lessons import hello

    # The cluster lives for the whole session: an earlier test may have built the op already.
    before = dict(cluster.built)
    cluster.run(hello.train_tiny_deepspeed, 1, timeout=900)
    first = "".join(capsys.readouterr())  # DeepSpeed's line is the ranks' stdout; ours stderr
    assert "built successfully" not in first
    built = dict(cluster.built)
    assert ("gas_lab notice: built DeepSpeed's C++ op" in first) == (built != before)
    cluster.run(hello.train_tiny_deepspeed, 1)  # the op is in the environment's cache now
    assert "built" not in "".join(capsys.readouterr()) and cluster.built == built


def test_lesson00_says_built_only_when_the_ranks_built(cluster, capsys):
    """Lesson 00 times its first DeepSpeed run; "a one-time C++ build" only if one ran."""
    import nbformat

    from gas_lab.lessons import hello

    path = os.path.join(os.path.dirname(__file__), "..", "tutorials", "00_setup.ipynb")
    cell = next(c for c in nbformat.read(path, as_version=4).cells if c.get("id") == "ae29534a")
    assert "first DeepSpeed run" in cell.source
    built_before = dict(cluster.built)
    exec(cell.source, {"cluster": cluster, "hello": hello, "time": time})
    first = next(ln for ln in capsys.readouterr().out.splitlines() if "first DeepSpeed" in ln)
    assert ("C++ build" in first) == (cluster.built != built_before), first
    assert "its C++ op was built before" in first or cluster.built != built_before


def _spin(seconds):
    import time

    t = time.time()
    while time.time() - t < seconds:
        pass


def test_status_says_each_ranks_pid_device_memory_and_whether_it_is_busy(cluster):
    status = cluster.status()
    assert [(r.rank, r.pid, r.device, r.state) for r in status.ranks] == [
        (0, cluster.pids[0], "cpu", "idle"),
        (1, cluster.pids[1], "cpu", "idle"),
    ]
    assert all(20 < r.mb < 2000 for r in status.ranks)
    assert status.processes == 6 and sum(r.mb for r in status.ranks) < status.mb
    text = repr(status)
    assert text.splitlines()[0].startswith("gas_lab: this notebook's ranks: 2 ranks (gloo), 6 ")
    assert f"   1  {cluster.pids[1]:>7}  cpu" in text
    import threading

    work = threading.Thread(target=cluster.run, args=(_spin, 4))  # a call still running
    work.start()
    time.sleep(1.5)
    busy = cluster.status()
    work.join(timeout=60)
    import inspect

    line = inspect.getsourcelines(_spin)[1] + 4  # the loop's line
    assert [r.state.split(" (")[0] for r in busy.ranks] == [
        f"busy: computing in _spin line {line}"
    ] * 2
    assert [r.state for r in cluster.status().ranks] == ["idle", "idle"]


def test_everything_listens_on_loopback_only(cluster):
    procs = psutil.Process().children(recursive=True)
    listening = [c.laddr.ip for p in procs for c in p.net_connections() if c.status == "LISTEN"]
    assert listening, "expected the controller and gloo to listen somewhere"
    assert set(listening) == {"127.0.0.1"}


_CHILD = """
import gas_lab, json, sys
c = gas_lab.start_cluster(world_size=2)
c2 = gas_lab.start_cluster(world_size=2, restart=True)
print(json.dumps(c2.pids)); sys.stdout.flush()
{end}
"""


@pytest.mark.parametrize("end", ["gas_lab.stop_cluster()", "pass  # interpreter exit"])
def test_no_process_survives_stop_or_exit(end):
    """Restart, stop and a plain interpreter exit (what a kernel shutdown is) leave nothing."""
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD.format(end=end)],
        capture_output=True,
        text=True,
        timeout=180,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    pids = [int(p) for p in proc.stdout.strip().splitlines()[-1].strip("[]").split(",")]
    deadline = time.monotonic() + 15
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    leaked = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert leaked == []


def test_one_notebooks_ranks_are_six_light_processes(cluster):
    """2 ranks and the process that forked them (rank_process.py), ipyparallel's controller (its
    schedulers are threads) with its heart monitor, and the guardian: one notebook's whole cost
    on a laptop. (A test's own processes, such as the fresh-rank forker, are not counted.)"""
    procs = [*cluster_processes(cluster.cluster_id), psutil.Process(cluster._guardian.pid)]
    names = sorted(" ".join(p.cmdline()[1:3]) for p in procs)
    assert len(procs) == 6, names
    assert sum("rank_process" in n for n in names) == 3 and sum("lifetime" in n for n in names) == 1


_FIRST = """
import gas_lab, json, sys
c = gas_lab.start_cluster(world_size=2, device="cpu")
print(json.dumps(c.pids), flush=True)
sys.stdin.read()  # a notebook left open
gas_lab.stop_cluster()
"""
_SECOND = """
import gas_lab
c = gas_lab.start_cluster(world_size=2, device="cpu")
print(c.status())
assert gas_lab.start_cluster(device="cpu", stop_others=True) is c
gas_lab.stop_cluster()
"""


def test_a_second_notebook_names_the_first_ones_ranks_and_can_stop_them(tmp_path):
    # Their own temporary folder: what this test process runs is no other notebook of theirs.
    env = os.environ | {"TMPDIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen(
        [sys.executable, "-c", _FIRST],
        env=env | {"JPY_SESSION_NAME": "/course/tutorials/04_unmanaged.ipynb"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pids = json.loads(first.stdout.readline())
        second = run_command(
            [sys.executable, "-c", _SECOND],
            timeout=180,
            env=env | {"JPY_SESSION_NAME": "/course/tutorials/05_zero1.ipynb"},
        )
        assert second.returncode == 0, second.stderr
        named = re.search(
            r"gas_lab notice: another notebook's ranks are running: 04_unmanaged.ipynb "
            r"\(5 processes, \d+ MB\)\. .* start with gas_lab.start_cluster\(stop_others=True\)",
            second.stderr,
        )
        assert named, second.stderr
        assert (
            "gas_lab notice: stopped the ranks of 04_unmanaged.ipynb (5 processes" in second.stderr
        )
        # ... and the status the second notebook shows names them too, with how to stop them.
        assert "Other notebooks' ranks on this machine: 04_unmanaged.ipynb (5 processes" in (
            second.stdout
        )
        assert not [
            p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
        ]
    finally:
        first.kill()
        first.wait()


def test_bad_device_is_a_clear_error():
    with pytest.raises(ValueError, match="device='tpu'"):
        gas_lab.start_cluster(device="tpu")


_GPU_CHILD = """
import gas_lab, json, torch
from gas_lab.lessons import hello
c = gas_lab.start_cluster()
out = c.run(hello.all_reduce_hello)
import torch.distributed as dist
backends = c.run(dist.get_backend)
print(json.dumps({"world": c.world_size, "received": [r["received"] for r in out],
                  "backends": backends, "gpus": torch.cuda.device_count()}))
gas_lab.stop_cluster()
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_machine_ranks_default_to_one_per_gpu_with_nccl():
    proc = subprocess.run(
        [sys.executable, "-c", _GPU_CHILD], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    w = out["gpus"]
    assert out["world"] == w and out["backends"] == ["nccl"] * w
    assert out["received"] == [w * (w + 1) / 2] * w


def test_readme_and_lesson00_name_every_runtime_call_a_lesson_uses():
    """``cluster.push`` was used in lesson 07 and explained nowhere: every ``cluster.<name>`` and
    ``%%ranks`` option the tutorials use is named in the README's runtime section and lesson 00."""
    import glob

    import nbformat

    root = os.path.join(os.path.dirname(__file__), "..")
    used = set()
    for path in glob.glob(os.path.join(root, "tutorials", "*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "code":
                used |= set(re.findall(r"\bcluster\.([a-z_]+)", cell.source))
                used |= {f"%%ranks {o}" for o in re.findall(r"%%ranks (--[a-z]+)", cell.source)}
    assert {"run", "push", "pull", "stop"} <= used
    with open(os.path.join(root, "README.md")) as f:
        readme = f.read().split("## The runtime: ranks in a notebook")[1].split("\n## ")[0]
    lesson = "\n".join(
        c.source for c in nbformat.read(os.path.join(root, "tutorials", "00_setup.ipynb"), 4).cells
    )
    for name in sorted(used):
        call = name if name.startswith("%%") else f"cluster.{name}"
        assert call in readme, f"the README's runtime section does not name {call}"
        assert call in lesson, f"lesson 00 does not name {call}"
