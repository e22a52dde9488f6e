"""DeepSpeed's C++ ops are built once per environment, by ``make ops`` (gas_lab/runtime/ops.py),
before any test or notebook waits on them; a symlinked path to the environment reaches the same
build. (The session itself fails if a test builds one: tests/conftest.py.)"""

import os
import re
import shutil
import sys

from gas_lab.runtime import build_lock, ops
from gas_lab.runtime.lifetime import run_command

ROOT = build_lock.extensions_root()


def _built(op: str) -> str:
    library = os.path.join(ROOT, op, f"{op}.so")
    assert os.path.exists(library), f"DeepSpeed's op {op} is not built in {ROOT}: run `make ops`"
    return library


def test_the_command_loads_what_is_built_and_says_so_per_op():
    stamps = {op: os.stat(_built(op)).st_mtime_ns for op in ops.OPS}
    proc = run_command([sys.executable, "-m", "gas_lab.runtime.ops"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for op in ops.OPS:
        assert re.search(
            rf"^gas_lab ops: {op}: built already \([\d.]+ s to load\)$", proc.stdout, re.M
        )
    assert {op: os.stat(_built(op)).st_mtime_ns for op in ops.OPS} == stamps
    assert "cc1plus" not in proc.stdout + proc.stderr  # the compiler's lines go to the op's log


def test_a_symlinked_environment_reaches_the_same_build(tmp_path):
    """Through a symlink to the environment, every path PyTorch writes into the op's build file
    would be new, and ninja would compile again: the real-paths hook keeps them the same."""
    op = "deepspeed_shm_comm"
    cache = tmp_path / "cache"
    shutil.copytree(os.path.dirname(_built(op)), cache / op, ignore=shutil.ignore_patterns("lock"))
    before = (cache / op / f"{op}.so").stat().st_mtime_ns
    link = tmp_path / "env"
    link.symlink_to(os.path.realpath(sys.prefix))
    python = link / os.path.relpath(sys.executable, sys.prefix)
    load = (
        "import deepspeed; from deepspeed.accelerator import get_accelerator; "
        "get_accelerator().create_op_builder('ShareMemCommBuilder').load(); print(deepspeed.__file__)"
    )
    env = os.environ | {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(cache)}
    # a rebuild would take minutes: a short timeout is the failure
    proc = run_command([str(python), "-c", load], timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert str(link) not in (cache / op / "build.ninja").read_text()
    assert (cache / op / f"{op}.so").stat().st_mtime_ns == before
    assert proc.stdout.strip().splitlines()[-1].startswith(os.path.realpath(sys.prefix))
