"""The tutorial scripts run unchanged under torchrun on 2 CPU processes."""

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from gas_lab.runtime.fresh import free_port

ROOT = Path(__file__).resolve().parents[1]


def torchrun(script: str, *args: str) -> dict:
    """Run a tutorial script under torchrun and return rank 0's last JSON line."""
    return _json_lines(script, *args)[-1]


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


# ------------------------------------------------ a script written for DeepSpeed, run on gas_lab
SCRIPT = ROOT / "tutorials/scripts/deepspeed_style.py"
CONFIG = ROOT / "tutorials/scripts/ds_config.json"


def _json_lines(script: str, *args: str) -> list[dict]:
    """Every JSON line rank 0 printed (torchrun, 2 CPU processes)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tutorials/scripts" / script), *args]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _json_of(proc.stdout)


def _json_of(stdout: str) -> list[dict]:
    """The JSON lines of a script's output (rank 0 prints them)."""
    return [json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{")]


def _assert_same_run(ours: list[dict], theirs: list[dict]) -> None:
    steps = [r for r in theirs if "summary" not in r]
    assert len(steps) >= 6 and len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        if "summary" in a:
            assert a["params_sum"] == pytest.approx(b["params_sum"], abs=1e-5)
            continue
        assert abs(a["loss"] - b["loss"]) <= 1e-6, (a, b)
        assert (a["global_steps"], a["global_samples"]) == (b["global_steps"], b["global_samples"])
        assert (a["grad_norm"] is None) == (b["grad_norm"] is None), (a, b)
        if a["grad_norm"] is not None:
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert len({round(r["loss"], 4) for r in steps}) > 1  # it trained: the loss moved


@pytest.mark.ranks
def test_a_deepspeed_style_script_runs_unchanged_on_gas_lab():
    """Fresh processes, DeepSpeed's usual launch: ``--deepspeed_config`` read from ``args``,
    ``args.local_rank`` set, ``deepspeed.comm`` ready after ``initialize``, the engine's
    loader and attributes; only ``--engine`` differs, and so do no numbers. DeepSpeed's engine
    runs under the ``deepspeed`` launcher (the run the /dev/shm test below watches), gas_lab's
    under torchrun."""
    flags = ["--deepspeed", "--deepspeed_config", str(CONFIG)]
    ours = _json_lines("deepspeed_style.py", *flags, "--engine", "gas_lab")
    theirs = _json_of(_under_deepspeed("deepspeed_style.py").stdout)
    assert ours[-1]["engine"] == "gas_lab" and theirs[-1]["engine"] == "deepspeed"
    _assert_same_run([{k: v for k, v in r.items() if k != "engine"} for r in ours],
                     [{k: v for k, v in r.items() if k != "engine"} for r in theirs])  # fmt: skip


def _script_run(argv: list[str]) -> list[dict]:
    """On a rank: the script's main() as it is, with ``argv``."""
    import importlib.util
    import io
    from contextlib import redirect_stdout

    from deepspeed.runtime.engine import DeepSpeedEngine

    spec = importlib.util.spec_from_file_location("deepspeed_style", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    # DeepSpeed's loader forks 2 worker processes per rank. A notebook rank runs ipyparallel's
    # threads, and a fork from it deadlocked once in the child (seen under `make test`); a rank
    # that ran ZeRO-3 engines before can also be refused the fork (ENOMEM: DeepSpeed 0.19.8 keeps
    # ~1.9 GB of address space per ZeRO-3 engine). Workers change no number, so here DeepSpeed
    # loads in the rank itself, as gas_lab's loader does; under torchrun (above) it forks.
    io_as_is = DeepSpeedEngine.deepspeed_io
    DeepSpeedEngine.deepspeed_io = lambda self, *a, **k: io_as_is(
        self, *a, **{**k, "num_local_io_workers": 0}
    )
    try:
        with redirect_stdout(io.StringIO()):
            return script.main(argv)
    finally:
        DeepSpeedEngine.deepspeed_io = io_as_is


@pytest.mark.ranks
@pytest.mark.parametrize("managed", [True, False], ids=["managed", "unmanaged"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_the_script_matches_deepspeed_at_every_stage(cluster, tmp_path, stage, managed):
    config = json.loads(CONFIG.read_text())
    config["zero_optimization"]["stage"] = stage
    config["managed_gradient_accumulation"] = managed
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    argv = ["--deepspeed", "--deepspeed_config", str(path)]
    logs = {
        engine: cluster.run(_script_run, [*argv, "--engine", engine], timeout=300)
        for engine in ("gas_lab", "deepspeed")
    }
    for ours, theirs in zip(logs["gas_lab"], logs["deepspeed"], strict=True):
        _assert_same_run(ours, theirs)


# ------------------------------------- what the `deepspeed` launcher leaves in /dev/shm (issue 31)
@dataclass
class Launched:
    """One script's run under the ``deepspeed`` launcher, and its /dev/shm files."""

    stdout: str
    pattern: str  # the names of this run's buffer files
    seen: set[str]  # while it ran
    left: list[str]  # after it exited (removed by the test)


_LAUNCHED: dict[str, Launched] = {}
_LAUNCHER_ARGS = {"hello_ranks.py": ["--steps", "1"], "train_unmanaged.py": ["--steps", "2"],
                  "deepspeed_style.py": ["--deepspeed", "--deepspeed_config", str(CONFIG)]}  # fmt: skip


def _under_deepspeed(script: str) -> Launched:
    """Run ``script`` once per session under ``deepspeed --num_gpus 2`` (a launch is seconds of
    start-up; two tests read this one), watching /dev/shm for its buffers while it runs."""
    if script in _LAUNCHED:
        return _LAUNCHED[script]
    import threading
    import time

    port = free_port()  # the port is in the file names: only this run's files match
    pattern = f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*"
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2",
           "--master_port", str(port), str(ROOT / "tutorials/scripts" / script),
           *_LAUNCHER_ARGS[script]]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    seen: set[str] = set()
    done = threading.Event()

    def watch():  # the files live from deepspeed.initialize to the end of the script
        while not done.is_set():
            seen.update(p.name for p in Path("/dev/shm").glob(pattern))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    finally:
        done.set()
        watcher.join()
        left = sorted(p.name for p in Path("/dev/shm").glob(pattern))
        for name in left:  # never leave them to the machine, even when the test fails
            (Path("/dev/shm") / name).unlink(missing_ok=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _LAUNCHED[script] = Launched(proc.stdout, pattern, seen, left)
    return _LAUNCHED[script]


@pytest.mark.ranks
@pytest.mark.parametrize("script", list(_LAUNCHER_ARGS))
def test_a_script_under_the_deepspeed_launcher_leaves_dev_shm_as_it_found_it(script):
    """Under ``deepspeed`` on one machine, DeepSpeed's CPU op creates one 66 MiB file per rank in
    /dev/shm and never removes it (tutorials/scripts/shm_buffers.py says where); each script
    removes its own. The files must appear while it runs (else this test proves nothing), and be
    gone after it exits."""
    run = _under_deepspeed(script)
    assert run.seen == {run.pattern.replace("*", str(rank)) for rank in (0, 1)}, run.seen
    assert run.left == [], f"{script} left {run.left} in /dev/shm"
