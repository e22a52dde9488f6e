"""The tutorial scripts run unchanged under torchrun on 2 CPU processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def torchrun(script: str, *args: str, nproc: int = 2, timeout: int = 180) -> dict:
    """Run a tutorial script under torchrun and return rank 0's last JSON line."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(ROOT / "tutorials/scripts" / script),
        *args,
    ]
    env = os.environ | {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1])


@pytest.mark.ranks
def test_hello_ranks_under_torchrun_matches_the_notebook_runtime(cluster):
    from gas_lab.lessons import hello

    out = torchrun("hello_ranks.py", "--steps", "3")
    assert out["backend"] == "gloo" and out["world_size"] == 2
    assert out["all_reduce"] == 3.0  # 1 + 2
    assert out["param_spread"] == 0.0  # both ranks hold the same parameters
    # 3 optimizer steps x GAS 2 = 6 micro-steps; 3 x (4 samples x GAS 2 x 2 ranks) = 48 samples
    assert (out["global_steps"], out["micro_steps"], out["global_samples"]) == (3, 6, 48)
    # The same function on the notebook's persistent ranks gives the same parameters.
    in_notebook = cluster.run(hello.train_tiny_deepspeed, 3, timeout=300)
    assert in_notebook[0]["params"].sum().item() == pytest.approx(out["params_sum"], abs=1e-6)
