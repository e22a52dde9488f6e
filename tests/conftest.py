"""Shared fixtures. ``cluster`` starts the 2 persistent ranks once for the whole test session;
``fused`` is the same ranks with DeepSpeed's FusedAdam op built or loaded."""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest


def pytest_configure(config):
    """Under pytest-xdist each worker is a machine of its own: its ranks live in its own temporary
    folder, so a notebook run by the other worker is not "another notebook's ranks" here."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        config._worker_tmp = tempfile.mkdtemp(prefix=f"gas_lab_{worker}_")
        os.environ["TMPDIR"] = config._worker_tmp
        tempfile.tempdir = None  # gettempdir() reads TMPDIR again


def pytest_unconfigure(config):
    """A worker's folder goes with it (the caches and checkpoints its tests and notebooks left
    there, about 1.6 MB a run); its ranks and kernels have ended by now."""
    folder = getattr(config, "_worker_tmp", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


# DeepSpeed's CPU op leaves one 66 MiB file per rank in /dev/shm under the `deepspeed` launcher
# (tutorials/scripts/shm_buffers.py); the session must end with no more of them than it began
# with. The names hold the user id, so only files this user's processes could have made count;
# a DeepSpeed job this user runs outside the session, on this machine, meanwhile counts too.
SHM_BUFFERS = f"deepspeed_allreduce_buffer_{os.getuid()}_*"


def _shm_buffers() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(SHM_BUFFERS)}


# DeepSpeed's C++ ops are built by `make ops` before the session (gas_lab/runtime/ops.py): a build
# inside a test worker or a notebook would make everything beside it wait on two shared cores.
# The cache is the environment's own, as gas_lab.runtime.build_lock picks it (not imported here:
# the controller would import torch for it).
OPS_CACHE = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path(sys.prefix) / "torch_extensions")


def _built_ops() -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in OPS_CACHE.glob("*/*.so")}


def pytest_sessionstart(session):
    session.config._shm_buffers_before = _shm_buffers()
    session.config._ops_before = _built_ops()


def pytest_sessionfinish(session, exitstatus):
    """The session (under xdist: the controller, once every worker is done) fails if it leaves
    DeepSpeed shared-memory buffers behind (the message names them and how to remove them), or
    if it built one of DeepSpeed's C++ ops in the environment's cache."""
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller checks once, over every worker's work
    messages = []
    left = sorted(_shm_buffers() - session.config._shm_buffers_before)
    if left:
        messages.append(
            f"/dev/shm: the tests left {len(left)} DeepSpeed buffer(s) behind: {', '.join(left)} "
            "(docs/instructor/troubleshooting.md, 'Memory a script leaves behind')"
        )
    before, after = session.config._ops_before, _built_ops()
    built = sorted(op for op, stamp in after.items() if before.get(op) != stamp)
    if built:
        messages.append(
            f"the session built DeepSpeed's C++ op(s) {', '.join(built)} in {OPS_CACHE}: "
            "`make ops` builds them before the tests, so that no test waits for a compiler"
        )
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for message in messages:
        if reporter is not None:
            reporter.write("\n")
            reporter.write_line(message, red=True)
    if messages:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# The slowest files of a fresh clone's `.ci/run` on 2026-12-07 (--durations on 3 workers, `make
# bench` 11.5 ms: A6 91 s, 07 66 s, 09 60 s, 00 53 s, test_check's two slowest 53 and 52 s, A5
# 47 s, A3 47 s), handed out first so that none of them is what the run waits for at its end. An
# order only: a stale name here changes nothing else.
SLOW_FIRST = ["A6_your_own_loop.ipynb", "test_check.py", "07_capstone.ipynb",
              "09_beyond_zero1.ipynb", "00_setup.ipynb", "A5_memory_and_offload.ipynb",
              "A3_idle_ranks.ipynb", "test_kernel.py"]  # fmt: skip


def pytest_collection_modifyitems(config, items):
    """The slowest files first, then the other notebooks, the docs site (it waits for the
    executed notebooks, then builds and opens the site while the other workers go on), the files
    with a ``ranks`` test, and the rest; each file's tests in their own order. ``make test`` hands
    whole files to its workers in this order, so the long ones start early and the many short
    ones fill the end evenly."""
    ranks = {item.path for item in items if item.get_closest_marker("ranks") is not None}

    def group(item):
        if item.path.name in SLOW_FIRST:
            return (0, SLOW_FIRST.index(item.path.name))
        if item.path.suffix == ".ipynb":
            return (1, 0)
        if item.get_closest_marker("docs") is not None:
            return (2, 0)
        return (3, 0) if item.path in ranks else (4, 0)

    items.sort(key=group)  # stable: the order within a file holds


@pytest.fixture(scope="session")
def cluster():
    import gas_lab

    # 2 CPU ranks everywhere, GPU machine or not, so the tests check the same thing everywhere.
    c = gas_lab.start_cluster(world_size=2, device="cpu")
    yield c
    gas_lab.stop_cluster()


@pytest.fixture(autouse=True)
def _first_try():
    """Every test checks an exercise from a first wrong try (the hint comes on the second)."""
    from exercise_support import reset_tries

    reset_tries()


def _load_fused_adam():
    """On a rank: load DeepSpeed's FusedAdam op, which `make ops` built."""
    import time

    from deepspeed.ops.op_builder import FusedAdamBuilder

    start = time.perf_counter()
    FusedAdamBuilder().load()
    return time.perf_counter() - start


@pytest.fixture(scope="session")
def fused(cluster):
    """The ranks, with DeepSpeed's FusedAdam op loaded (tests of DeepSpeed's default optimizer
    path); `make ops` built it, so a missing build fails here instead of compiling for minutes."""
    if "fused_adam.so" not in _built_ops():
        pytest.fail(f"DeepSpeed's FusedAdam op is not built in {OPS_CACHE}: run `make ops`")
    seconds = cluster.run(_load_fused_adam, timeout=120)
    print(f"FusedAdam op loaded in {max(seconds):.1f} s")
    return cluster
