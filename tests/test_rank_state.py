"""Telling a stalled rank from a busy one (issue 14, part 4), from the stack a rank reports."""

from gas_lab.runtime.rank_state import classify, dump_frames

SITE = "/venv/lib/python3.11/site-packages"
USER = ("<dynamic-code>", 6, "train")
RUNTIME = ("/repo/gas_lab/runtime/on_rank.py", 120, "call_on_rank")


def test_a_rank_in_a_collective_is_waiting():
    frames = [
        (f"{SITE}/torch/distributed/distributed_c10d.py", 3252, "all_reduce"),
        (f"{SITE}/torch/distributed/c10d_logger.py", 83, "wrapper"),
        USER,
        RUNTIME,
    ]
    state = classify(frames, [], cpu=0.0)
    assert state.kind == "collective" and not state.starting_up
    assert state.text == "waiting in a collective (all_reduce, called from train line 6)"


def test_importing_and_building_are_start_up_work():
    importing = [
        (f"{SITE}/deepspeed/ops/__init__.py", 5, "<module>"),
        ("<frozen importlib._bootstrap>", 1, "_call_with_frames_removed"),
        (f"{SITE}/deepspeed/__init__.py", 10, "<module>"),
        ("<frozen importlib._bootstrap>", 1, "_find_and_load"),
        USER,
        RUNTIME,
    ]
    state = classify(importing, [], cpu=95.0)
    assert state.kind == "importing" and state.starting_up
    assert state.text == "importing deepspeed (from train line 6)"
    building = [(f"{SITE}/torch/utils/cpp_extension.py", 2100, "_run_ninja_build"), *importing]
    # PyTorch runs ninja at every first load: without a compiler under it, that is a load
    loading = classify(building, ["ninja"], cpu=1.0)
    assert loading.kind == "loading" and loading.starting_up
    assert loading.text == "loading a C++ op for DeepSpeed (ninja checks that it is up to date)"
    assert classify(building, ["ninja", "cc1plus"], cpu=1.0).kind == "building"
    assert classify(importing, ["ninja", "c++"], cpu=1.0).kind == "building"
    baton = [(f"{SITE}/torch/utils/file_baton.py", 50, "wait"), *building]
    assert classify(baton, [], cpu=0.0).kind == "build_lock"


def test_anything_else_is_computing():
    state = classify([("<dynamic-code>", 9, "spin"), RUNTIME], [], cpu=99.0)
    assert state.kind == "computing" and state.text == "computing in spin line 9 (99% CPU)"


def test_the_stack_is_read_from_a_faulthandler_dump():
    dump = (
        "Stack (most recent call first):\n"
        '  File "/x/threading.py", line 1 in wait\n\n'
        "Stack (most recent call first):\n"  # the latest sample is the one asked for
        '  File "<dynamic-code>", line 9 in spin\n'
    )
    assert dump_frames(dump) == [("<dynamic-code>", 9, "spin")]


def test_a_dump_that_pauses_part_way_is_read_to_its_end(tmp_path):
    """On a loaded machine the rank's signal handler can pause between two lines of the dump."""
    import threading
    import time

    from gas_lab.runtime.rank_state import _read_stack

    path = tmp_path / "stack.txt"
    path.write_text("")

    def write():
        with open(path, "a") as f:
            f.write("Stack (most recent call first):\n")
            f.flush()
            time.sleep(0.3)  # paused part-way
            f.write('  File "<dynamic-code>", line 9 in spin\n')

    writer = threading.Thread(target=write)
    writer.start()
    frames = _read_stack(str(path), 0, wait=2.0)
    writer.join()
    assert frames == [("<dynamic-code>", 9, "spin")]


def test_a_sample_dumps_only_the_main_thread_and_survives_threads_that_come_and_go(tmp_path):
    """A dump of every thread reads the others' frames while they run: with threads starting
    and ending (as in DeepSpeed's start-up) it crashed the process about 1 signal in 440."""
    import subprocess
    import sys

    from gas_lab.runtime.rank_state import sample

    child = subprocess.Popen(
        [sys.executable, "-c", _CHURN, str(tmp_path / "stack.txt")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        child.stdout.readline()
        for _ in range(10):
            state = sample(child.pid, str(tmp_path / "stack.txt"), wait=1.0)
            assert child.poll() is None, f"the process died: {child.returncode}"
            assert state.frames[0][2] == "main_loop", state  # the main thread's stack
        assert "Thread 0x" not in (tmp_path / "stack.txt").read_text()  # and no other thread
    finally:
        child.kill()
        child.wait()


_CHURN = """
import sys, tempfile, threading, time
from gas_lab.runtime.on_rank import _watch_stack_and_crash
_watch_stack_and_crash(sys.argv[1], tempfile.mkdtemp(), 0)

def churn():
    while True:
        threads = [threading.Thread(target=sum, args=(range(100),)) for _ in range(4)]
        [t.start() for t in threads]
        [t.join() for t in threads]

threading.Thread(target=churn, daemon=True).start()

def main_loop():
    print("ready", flush=True)
    while True:
        time.sleep(0.001)

main_loop()
"""


def test_a_compiler_that_exits_while_listed_is_skipped_not_a_failed_sample():
    """A build's compilers come and go; one gone between listing and naming is not an error."""
    import psutil

    from gas_lab.runtime.rank_state import _children_names

    class Gone:
        def name(self):
            raise psutil.NoSuchProcess(12345)

    class Ninja:
        def name(self):
            return "ninja"

    class Rank:
        def children(self, recursive):
            return [Gone(), Ninja()]

    assert _children_names(Rank()) == ["ninja"]
