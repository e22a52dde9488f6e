"""The checks behind `make gpu-check`, run by tools/gpu_check.sh with a Python whose torch sees CUDA.

Each check is a command with its own time limit and a verdict read from its output (not only its
exit code). At the end a table says what ran, what passed and how long each took; checks that
cannot run on this machine (or past the time budget) are listed as not run, with the reason.
Exit status: 0 when every check that ran passed, 1 otherwise.

    python tools/gpu_check.py [--budget SECONDS]       # default 480 (8 minutes) in all
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "gpu-check"  # executed notebooks and logs, outside the sources
PY = sys.executable


@dataclass
class Row:
    name: str
    ran: bool = False
    passed: bool = False
    seconds: float = 0.0
    note: str = ""


def last_json(text: str) -> dict:
    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    if not lines:
        raise ValueError("no JSON line in the output")
    return json.loads(lines[-1])


def run(cmd: list[str], timeout: float, log: Path) -> tuple[int | None, str]:
    """Run ``cmd`` in its own process group; kill the whole group past ``timeout``."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    return rc, log.read_text(errors="replace")


def pytest_summary(text: str) -> str:
    tail = [ln for ln in text.splitlines() if " passed" in ln or " failed" in ln or "error" in ln]
    return tail[-1].strip("= ") if tail else "no pytest summary"


@dataclass
class Check:
    name: str
    cmd: list[str]
    timeout: float
    verdict: Callable[[int, str], tuple[bool, str]]  # (exit code, output) -> (passed, note)
    not_here: str = ""  # why this machine cannot run it (then it is listed, not run)


def checks(gpus: int) -> list[Check]:
    nb = [PY, "-m", "pytest", "-p", "no:cacheprovider", "--nbmake", "--nbmake-timeout=300"]
    torchrun = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"]
    ds_launch = [PY, "-m", "deepspeed.launcher.runner", "--num_gpus", str(gpus)]
    hello = ["tutorials/scripts/hello_ranks.py"]
    train = ["tutorials/scripts/train_unmanaged.py", "--steps", "5"]
    # Lessons 00 and 07 need >= 2 ranks (a failing rank 1, a stall, ragged ranks), and nccl
    # refuses two ranks on one GPU, so on one GPU they are listed as not run.
    two = "" if gpus >= 2 else "needs 2 GPUs: the lesson runs >= 2 ranks, nccl one GPU per rank"

    def pytest_ok(rc, out):
        return rc == 0, pytest_summary(out)

    def hello_ok(rc, out):
        r = last_json(out)
        ok = rc == 0 and r["backend"] == "nccl" and r["world_size"] == gpus
        ok = ok and r["all_reduce"] == gpus * (gpus + 1) / 2 and r["param_spread"] == 0.0
        return ok, f"{r['backend']}, {r['world_size']} ranks, all_reduce {r['all_reduce']:g}"

    def train_ok(rc, out):
        r = last_json(out)
        ok = rc == 0 and r.get("summary") and r["backend"] == "nccl" and r["world_size"] == gpus
        ok = bool(ok and r["global_steps"] == 5 and r["param_spread"] == 0.0)
        return ok, f"{r['backend']}, {r['world_size']} ranks, final loss {r['final_loss']:.4f}"

    gpu_tests = [PY, "-m", "pytest", "-p", "no:cacheprovider", "-m", "gpu", "-q", "-rs", "tests"]
    return [
        Check("hello_ranks.py, torchrun", torchrun + hello, 120, hello_ok),
        Check("hello_ranks.py, deepspeed", ds_launch + hello, 120, hello_ok),
        Check("train_unmanaged.py, torchrun", torchrun + train, 150, train_ok),
        Check("train_unmanaged.py, deepspeed", ds_launch + train, 150, train_ok),
        Check("tests marked gpu", gpu_tests, 360, pytest_ok),
        Check("lesson 00 (nbmake, nccl)", nb + [str(WORK / "00_setup.ipynb")], 240, pytest_ok, two),
        Check(
            "lesson 07 (nbmake, nccl)", nb + [str(WORK / "07_capstone.ipynb")], 300, pytest_ok, two
        ),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for every check")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget

    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        print("gpu-check: torch sees no GPU here, so nothing was run.")
        return 0
    import deepspeed

    names = sorted({torch.cuda.get_device_name(i) for i in range(gpus)})
    print(
        f"gpu-check: {gpus} x {', '.join(names)}; torch {torch.__version__} (CUDA "
        f"{torch.version.cuda}); deepspeed {deepspeed.__version__}; budget {args.budget:.0f} s",
        flush=True,
    )
    shutil.rmtree(WORK, ignore_errors=True)
    shutil.copytree(ROOT / "tutorials", WORK)  # notebooks run beside scripts/, as in make test
    rows = []
    for i, check in enumerate(checks(gpus)):
        row = Row(check.name)
        rows.append(row)
        left = deadline - time.monotonic()
        if check.not_here or left < 20:
            row.note = check.not_here or "out of the time budget"
            continue
        print(f"gpu-check: {check.name} ...", flush=True)
        log = WORK / f"check{i}.log"
        limit = min(check.timeout, left)
        t0 = time.perf_counter()
        rc, out = run(check.cmd, limit, log)
        row.ran, row.seconds = True, time.perf_counter() - t0
        if rc is None:
            row.note = f"timed out after {limit:.0f} s"
        else:
            try:
                row.passed, row.note = check.verdict(rc, out)
            except (ValueError, KeyError) as err:
                row.note = f"exit {rc}: {err}"
        if not row.passed:
            row.note += f" (log: {log.relative_to(ROOT)})"
    print_table(rows, args.budget - (deadline - time.monotonic()))
    return 0 if all(r.passed for r in rows if r.ran) else 1


def print_table(rows: list[Row], spent: float) -> None:
    width = max(len(r.name) for r in rows)
    print(f"\n{'check':<{width}}  ran  result  seconds  note")
    for r in rows:
        result = ("pass" if r.passed else "FAIL") if r.ran else "-"
        secs = f"{r.seconds:7.1f}" if r.ran else "      -"
        print(f"{r.name:<{width}}  {'yes' if r.ran else 'no ':<3}  {result:<6}  {secs}  {r.note}")
    ran = [r for r in rows if r.ran]
    passed = sum(r.passed for r in ran)
    print(
        f"gpu-check: {len(ran)} ran, {passed} passed, {len(ran) - passed} failed, "
        f"{len(rows) - len(ran)} not run; {spent:.0f} s"
    )


if __name__ == "__main__":
    sys.exit(main())
