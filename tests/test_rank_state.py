"""Telling a stalled rank from a busy one (issue 14, part 4), from the stack a rank reports."""

from gas_lab.runtime.rank_state import classify, main_thread_frames

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
    assert classify(building, [], cpu=1.0).kind == "building"
    assert classify(importing, ["ninja", "cc1plus"], cpu=1.0).kind == "building"
    baton = [(f"{SITE}/torch/utils/file_baton.py", 50, "wait"), *building]
    assert classify(baton, [], cpu=0.0).kind == "build_lock"


def test_anything_else_is_computing():
    state = classify([("<dynamic-code>", 9, "spin"), RUNTIME], [], cpu=99.0)
    assert state.kind == "computing" and state.text == "computing in spin line 9 (99% CPU)"


def test_the_main_thread_is_read_from_a_faulthandler_dump():
    dump = (
        "Thread 0x00007f0000000002 (most recent call first):\n"
        '  File "/x/threading.py", line 1 in wait\n\n'
        "Current thread 0x00007f0000000001 (most recent call first):\n"
        '  File "<dynamic-code>", line 9 in spin\n'
    )
    assert main_thread_frames(dump, 0x7F0000000001) == [("<dynamic-code>", 9, "spin")]
