"""`make gpu-check` on a machine without a GPU: it says so, exits 0 and claims nothing ran."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.sh"
CLAIMS = re.compile(r"\bpass(ed)?\b|\bFAIL|\bran\b|making \.venv-gpu", re.IGNORECASE)


def path_without_nvidia_smi() -> str:
    dirs = os.environ["PATH"].split(os.pathsep)
    return os.pathsep.join(d for d in dirs if not os.path.exists(os.path.join(d, "nvidia-smi")))


def fake_nvidia_smi(tmp_path: Path, listing: str) -> str:
    """A PATH whose nvidia-smi prints ``listing`` (what the driver tool prints for -L)."""
    tool = tmp_path / "bin" / "nvidia-smi"
    tool.parent.mkdir()
    tool.write_text(f"#!/bin/sh\nprintf '{listing}'\n")
    tool.chmod(0o755)
    return f"{tool.parent}{os.pathsep}{path_without_nvidia_smi()}"


def run(cmd, path, **env):
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    full = inherited | {"PATH": path} | env
    return subprocess.run(cmd, cwd=ROOT, env=full, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("how", ["no nvidia-smi", "nvidia-smi lists none", "make gpu-check"])
def test_without_a_gpu_it_says_so_and_runs_nothing(tmp_path, how):
    if how == "nvidia-smi lists none":
        proc = run(["bash", str(SCRIPT)], fake_nvidia_smi(tmp_path, ""))
        reason = "nvidia-smi lists none"
    else:
        cmd = ["make", "-s", "gpu-check"] if how == "make gpu-check" else ["bash", str(SCRIPT)]
        proc = run(cmd, path_without_nvidia_smi())
        reason = "nvidia-smi is not installed"
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first == f"gpu-check: no GPU on this machine ({reason}), so nothing was run."
    assert not CLAIMS.search(proc.stdout + proc.stderr), proc.stdout  # no table, no verdicts
    assert "run" in proc.stdout.splitlines()[1]  # it says what it would run on a GPU machine


def test_a_gpu_that_torch_cannot_see_is_a_clear_error(tmp_path):
    """nvidia-smi lists a GPU but the given Python's torch sees none (a CPU build): exit 1 with
    what to do, before running anything."""
    path = fake_nvidia_smi(tmp_path, "GPU 0: Fake (UUID: GPU-0)\\n")
    proc = run(
        ["bash", str(SCRIPT)], path, GPU_CHECK_PYTHON=sys.executable, CUDA_VISIBLE_DEVICES=""
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "lists 1 GPU(s)" in proc.stdout and "sees no GPU" in proc.stdout
    assert "GPU_CHECK_TORCH_INDEX" in proc.stdout and not CLAIMS.search(proc.stdout)


def test_the_runner_without_a_gpu_runs_nothing():
    env = os.environ | {"CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "tools/gpu_check.py"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert (
        proc.returncode == 0
        and proc.stdout == "gpu-check: torch sees no GPU here, so nothing was run.\n"
    )


def load_runner():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def test_table_counts_what_ran(capsys):
    gc = load_runner()
    rows = [
        gc.Row("a", ran=True, passed=True, seconds=1.0, note="ok"),
        gc.Row("b", ran=True, passed=False, seconds=2.0, note="exit 1"),
        gc.Row("c", note="needs 2 GPUs"),
    ]
    gc.print_table(rows, 3.0)
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "gpu-check: 2 ran, 1 passed, 1 failed, 1 not run; 3 s"
    assert out[-2].split()[:3] == ["c", "no", "-"] and out[-3].split()[:3] == ["b", "yes", "FAIL"]


def test_checks_cover_the_issue():
    """Scripts under both launchers with one rank per GPU, the gpu tests, lessons 00 and 07;
    on one GPU the lessons (>= 2 ranks) are listed as not run, with the reason."""
    gc = load_runner()
    one, two = gc.checks(1), gc.checks(2)
    names = [c.name for c in two]
    assert any("torchrun" in n and "hello" in n for n in names)
    assert any("deepspeed" in n and "train_unmanaged" in n for n in names)
    assert "tests marked gpu" in names
    assert {n for n in names if n.startswith("lesson")} == {
        "lesson 00 (nbmake, nccl)",
        "lesson 07 (nbmake, nccl)",
    }
    assert all(not c.not_here for c in two)
    assert [c.name for c in one if c.not_here] == [
        "lesson 00 (nbmake, nccl)",
        "lesson 07 (nbmake, nccl)",
    ]
    launcher = next(c for c in two if c.name == "hello_ranks.py, torchrun")
    assert "--nproc_per_node=2" in launcher.cmd
    assert sum(c.timeout for c in one if not c.not_here) <= 900  # each bounded; budget caps all


def test_gpu_requirements_are_the_projects_own():
    """.venv-gpu installs a subset of pyproject's dependencies, with the same pins."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = set(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        declared |= set(extra)
    lines = (ROOT / "tools" / "gpu_requirements.txt").read_text().splitlines()
    wanted = {ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")}
    assert wanted <= declared, wanted - declared
    assert "torch" not in {re.split(r"[<>=]", w)[0] for w in wanted}  # torch: the CUDA build
