"""tools/bench_step_time.py runs under torchrun and reports the three timings (not timed itself)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.ranks
def test_bench_prints_three_timings_and_ratios():
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "tools" / "bench_step_time.py"),
        *("--steps", "2", "--rounds", "2", "--warmup", "1", "--hidden", "8", "--gas", "3"),
    ]
    env = os.environ | {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for lib in ("gas_lab", "deepspeed", "ddp"):
        assert sum(ln.startswith(lib) and "ms per optimizer step" in ln for ln in lines) == 1, lib
    assert any(ln.startswith("ratios") and "gas_lab/ddp" in ln for ln in lines)
    result = json.loads([ln for ln in lines if ln.startswith("{")][-1])
    ms = result["ms_per_step"]
    assert set(ms) == {"gas_lab", "deepspeed", "ddp"} and all(v > 0 for v in ms.values())
    # The same loop really ran on all three: same parameters at the end.
    assert result["max_param_diff"] < 1e-5
    assert result["args"]["gas"] == 3 and "2 ranks (gloo)" in proc.stdout
