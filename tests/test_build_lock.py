"""Stale build locks (issue 14, part 5): a lock a live build holds is left alone; one that no
process holds is found, named and removed, also while a rank waits on it."""

import os
import subprocess
import sys
import time

import pytest

from gas_lab.runtime import build_lock

_HOLD = "import os, sys, time\nfd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL)\nprint(1, flush=True)\ntime.sleep(120)\n"


@pytest.fixture
def ext_root(tmp_path, monkeypatch):
    """A torch_extensions folder of our own (never the machine's real cache)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    (tmp_path / "py311_cpu" / "some_op").mkdir(parents=True)
    return tmp_path


def test_a_lock_a_live_build_holds_is_not_stale_until_the_build_dies(ext_root):
    lock = ext_root / "py311_cpu" / "some_op" / "lock"
    holder = subprocess.Popen(  # creates and keeps the lock open, as torch's FileBaton does
        [sys.executable, "-c", _HOLD, str(lock)], stdout=subprocess.PIPE, text=True
    )
    holder.stdout.readline()
    try:
        assert build_lock.locks() == [str(lock)]
        assert [p.pid for p in build_lock.holders(str(lock))] == [holder.pid]
        assert build_lock.stale_locks() == [] and build_lock.clear_stale_locks() == []
        assert lock.exists()
    finally:
        holder.kill()  # a build killed part-way: the lock stays behind
        holder.wait()
    said = []
    assert build_lock.clear_stale_locks(say=said.append) == [str(lock)]
    assert not lock.exists()
    assert said and "removed a stale build lock" in said[0] and str(lock) in said[0]


def test_a_compiler_working_in_the_folder_counts_as_a_live_build(ext_root):
    folder = ext_root / "py311_cpu" / "some_op"
    (folder / "lock").touch()  # nobody has it open, but ninja still runs there
    ninja = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=folder)
    try:
        time.sleep(0.3)
        assert build_lock.stale_locks() == []
    finally:
        ninja.kill()
        ninja.wait()
    assert build_lock.stale_locks() == [str(folder / "lock")]


def _wait_for_build(lock):
    from torch.utils.file_baton import FileBaton

    FileBaton(lock).wait()  # what a rank does while another process builds an op
    return "built"


@pytest.mark.ranks
def test_a_rank_waiting_on_a_stale_lock_is_freed(cluster, ext_root, capsys):
    lock = ext_root / "py311_cpu" / "some_op" / "lock"
    lock.touch()
    t0 = time.monotonic()
    assert cluster.run(_wait_for_build, str(lock), timeout=2) == ["built", "built"]
    assert time.monotonic() - t0 < 30 and not lock.exists()
    err = capsys.readouterr().err
    assert "is still waiting for a C++ op build lock" in err
    assert "removed a stale build lock (less than a minute old; no process held it)" in err


_CACHE = "import os, gas_lab; print(os.environ.get('TORCH_EXTENSIONS_DIR'))"


@pytest.mark.parametrize("given", [None, "/elsewhere/torch_extensions"])
def test_importing_gas_lab_builds_ops_in_the_environments_own_folder(given, monkeypatch):
    """Not ~/.cache, which every environment shares and rebuilds over; a folder set is kept."""
    if given:
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", given)
    else:
        monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    out = subprocess.run([sys.executable, "-c", _CACHE], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (given or f"{sys.prefix}/torch_extensions")


def test_a_build_is_told_from_a_load_by_the_op_library_and_timed_by_ninjas_log(ext_root):
    folder = ext_root / "some_op"  # TORCH_EXTENSIONS_DIR set: ops sit right under it
    folder.mkdir()
    before = build_lock.built_ops()
    assert before == {} and build_lock.builds_since(before) == {}
    (folder / ".ninja_log").write_text(
        "# ninja log v5\n0\t41000\t1\tops.o\tab\n41001\t41500\t2\tsome_op.so\tcd\n"
    )
    (folder / "some_op.so").write_bytes(b"")  # the link, the build's last step
    assert build_lock.builds_since(before) == {"some_op": 41.5}
    loaded = build_lock.built_ops()
    assert build_lock.builds_since(loaded) == {}  # loading it again builds nothing


@pytest.mark.parametrize(
    "library, words",
    [
        (None, "ended before it had built the op (no library is there)"),
        (+60, "ended after it had built the op, before it removed the lock"),
        (-60, "ended while it loaded the op, which was built already"),
    ],
)
def test_the_notice_says_what_the_folder_shows_of_who_left_the_lock(ext_root, library, words):
    """A lock alone is no killed build: every first load of an op takes it too."""
    folder = ext_root / "py311_cpu" / "some_op"
    (folder / "lock").touch()
    if library is not None:
        (folder / "some_op.so").touch()
        taken = (folder / "lock").stat().st_mtime
        os.utime(folder / "some_op.so", (taken + library, taken + library))
    said = []
    assert build_lock.clear_stale_locks(say=said.append) == [str(folder / "lock")]
    assert len(said) == 1 and words in said[0] and "killed" not in said[0]
