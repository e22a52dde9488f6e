"""Errors that blame the right thing (issue 14, part 4), on the real ranks.

A rank that dies is named first, with its signal or exit code; a return value that cannot travel
says so; a busy rank is not called stalled; start-up work (imports, C++ builds: a cold build in
tests/test_first_start.py) gets its time; bad arguments get one line naming the argument; huge
output is capped with a note.
"""

import psutil
import pytest

import gas_lab
from gas_lab.runtime.cluster import RankError, RankStallError
from gas_lab.runtime.streaming import OUTPUT_LIMIT

pytestmark = pytest.mark.ranks


def _segfault_on_rank_one():
    import ctypes

    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    dist.all_reduce(torch.ones(1))


def _exit_on_rank_one(code):
    import os

    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(code)
    dist.all_reduce(torch.ones(1))


def test_a_rank_that_segfaults_is_named_first_with_its_signal(cluster):
    old = list(cluster.pids)
    with pytest.raises(RankError) as info:
        cluster.run(_segfault_on_rank_one)
    msg = str(info.value)
    assert msg.startswith(
        "rank 1 died (killed by signal SIGSEGV) while running _segfault_on_rank_one"
    )
    assert "rank 0 raised RuntimeError" in msg and "(most likely because rank 1 died)" in msg
    assert msg.index("rank 1 died") < msg.index("rank 0 raised")
    crash = msg.split("--- where rank 1 crashed ---")[1].split("--- traceback on rank 0")[0]
    assert "Segmentation fault" in crash and "in _segfault_on_rank_one" in crash
    assert info.value.died == {1: "killed by signal SIGSEGV"}
    assert "EngineError" not in msg and "ipyparallel" not in msg
    assert not any(psutil.pid_exists(p) for p in old) and cluster.running


def test_a_rank_that_exits_is_named_with_its_exit_code(cluster):
    with pytest.raises(RankError) as info:
        cluster.run(_exit_on_rank_one, 3)
    assert str(info.value).startswith("rank 1 died (exit code 3) while running _exit_on_rank_one")
    assert "restarted" in str(info.value) and cluster.running


def _a_generator():
    return (i for i in range(3))


def test_a_result_that_cannot_be_sent_back_says_so(cluster):
    with pytest.raises(RankError) as info:
        cluster.run(_a_generator)
    msg = str(info.value)
    assert msg.startswith(
        "rank 0: the return value of _a_generator (a generator) cannot be sent back to the notebook"
    )
    assert "serialize" not in msg and "ipyparallel" not in msg
    assert info.value.stalled == [] and cluster.run(len, "ok") == [2, 2]  # ranks untouched


def _spin(seconds):
    import time

    t = time.time()
    while time.time() - t < seconds:
        pass
    return "finished"


def test_a_rank_busy_computing_is_stopped_not_called_stalled(cluster):
    cluster.execute("kept = 'still here'")
    pids = list(cluster.pids)
    with pytest.raises(RankStallError) as info:
        cluster.run(_spin, 60, timeout=2)
    msg = str(info.value)
    assert "did not finish within 2 s" in msg and "busy, not stalled in a collective" in msg
    assert "rank 0: computing in _spin line" in msg and "collective (all_reduce" not in msg
    assert "The work was stopped; the ranks keep their variables." in msg
    assert not info.value.restarted and cluster.pids == pids
    assert cluster.pull("kept") == ["still here", "still here"]


_SLOW_MODULE = "import time\ntime.sleep({seconds})\nVALUE = 42\n"


def _import_slow(folder):
    import sys

    sys.path.insert(0, folder)
    import gas_lab_slow_module

    return gas_lab_slow_module.VALUE


def test_start_up_work_gets_the_time_it_needs(cluster, tmp_path, capsys):
    """A rank still importing at the timeout is busy starting up, not stalled: the call waits."""
    (tmp_path / "gas_lab_slow_module.py").write_text(_SLOW_MODULE.format(seconds=6))
    assert cluster.run(_import_slow, str(tmp_path), timeout=2) == [42, 42]
    err = capsys.readouterr().err
    assert "is still importing gas_lab_slow_module (from _import_slow line" in err
    assert "start-up work, so the call waits for it" in err


def _import_slow_then_work(folder, seconds):
    import importlib
    import sys
    import time

    sys.path.insert(0, folder)
    value = importlib.import_module("gas_lab_slow_module_2").VALUE  # not imported on the ranks yet
    time.sleep(seconds)  # the work itself, past the moment the start-up work ended
    return value


def test_the_work_after_start_up_work_gets_the_calls_timeout(cluster, tmp_path, capsys):
    """Start-up work (4 s) outlasts the timeout (3 s); the work after it (2 s) must not be
    stopped by the first look that finds the start-up over (DeepSpeed's first start: the op
    built, the ranks in their first forward)."""
    (tmp_path / "gas_lab_slow_module_2.py").write_text(_SLOW_MODULE.format(seconds=4))
    assert cluster.run(_import_slow_then_work, str(tmp_path), 2.0, timeout=3) == [42, 42]
    assert "start-up work, so the call waits for it" in capsys.readouterr().err


def _print_a_lot(lines):
    for _ in range(lines):
        print("y" * 99)
    return "done"


def test_huge_output_is_capped_with_a_note(cluster, capsys):
    assert cluster.run(_print_a_lot, 50_000) == ["done", "done"]  # 5 MB per rank
    out, err = capsys.readouterr()
    assert len(out) < 2 * (OUTPUT_LIMIT + 20_000)
    assert "[rank 0] ... " in err and "more characters not shown" in err


@pytest.mark.parametrize(
    "world_size, error, says",
    [
        (0, ValueError, "start_cluster(world_size=0): world_size must be at least 1"),
        (-1, ValueError, "start_cluster(world_size=-1): world_size must be at least 1"),
        ("2", TypeError, "start_cluster(world_size='2'): world_size must be a whole number"),
        (2.5, TypeError, "start_cluster(world_size=2.5): world_size must be a whole number"),
        (3.0, TypeError, "start_cluster(world_size=3.0): world_size must be a whole number"),
    ],
)
def test_a_bad_world_size_is_one_line_naming_it(world_size, error, says):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(error) as info:
        gas_lab.start_cluster(world_size=world_size)
    assert str(info.value).startswith(says) and "\n" not in str(info.value)
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before  # nothing was started


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), "abc", None])
def test_a_bad_timeout_is_one_line_naming_it(cluster, timeout):
    with pytest.raises((TypeError, ValueError)) as info:
        cluster.run(len, "x", timeout=timeout)
    assert str(info.value).startswith(f"timeout={timeout!r}: the timeout must be")


def test_the_ranks_line_parser_names_the_option():
    from gas_lab.runtime.arguments import UsageError
    from gas_lab.runtime.arguments import parse_ranks_line as parse_line

    assert parse_line("", 60.0) == (60.0, None)
    assert parse_line("--timeout 300", 60.0) == parse_line("--timeout=300", 60.0) == (300.0, None)
    assert parse_line("--rank 0", 60.0) == parse_line("--rank=0", 60.0) == (60.0, [0])
    assert parse_line("--rank 1,0 --timeout 5", 60.0) == (5.0, [0, 1])
    bad = ("--timeout", "--timeout abc", "--timeout 0", "--timeout -1", "--verbose")
    for line in (*bad, "--rank", "--rank x", "--rank -1", "--rank 0,"):
        with pytest.raises(UsageError, match="^%%ranks"):
            parse_line(line, 60.0)
