"""More ranks than GPUs: refused, before any process starts, with a message that says why and what
to do instead. Checked on the CPU by making the runtime see one GPU; the premise (nccl itself
refuses two ranks on one GPU) is checked on a GPU."""

import json
import os
import signal
import subprocess
import sys

import psutil
import pytest
import torch

from gas_lab.runtime import cluster as runtime


@pytest.fixture
def one_gpu(monkeypatch):
    """The runtime sees a machine with one CUDA GPU; starting ranks is recorded, not done."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    started = []

    def start(self):
        started.append((self.world_size, self.backend))
        return self

    monkeypatch.setattr(runtime.Cluster, "start", start)
    monkeypatch.setattr(runtime.Cluster, "stop", lambda self: None)
    monkeypatch.setattr(runtime, "register_magic", lambda *a: None)
    monkeypatch.setattr(runtime.lifetime, "end_orphans", lambda: 0)
    monkeypatch.setattr(runtime, "_current", None)  # leave the session's ranks alone
    return started


@pytest.mark.parametrize("device", [None, "cuda"])
def test_two_ranks_on_one_gpu_are_refused_before_anything_starts(one_gpu, device):
    children = len(psutil.Process().children(recursive=True))
    with pytest.raises(ValueError) as err:
        runtime.start_cluster(world_size=2, device=device)
    message = str(err.value)
    assert "world_size=2" in message and "1 GPUs" in message  # what was asked, what exists
    assert "one GPU per rank" in message  # why
    assert "device='cpu'" in message and "world_size <= the GPU count" in message  # what to do
    assert one_gpu == [] and len(psutil.Process().children(recursive=True)) == children


def test_what_does_fit_on_one_gpu_is_started(one_gpu):
    assert runtime.default_world_size() == (1, "nccl")
    c = runtime.start_cluster()  # the default: one rank per GPU
    assert (c.world_size, c.backend) == (1, "nccl")
    runtime.start_cluster(world_size=2, device="cpu")  # 2 CPU ranks on a GPU machine: fine
    assert one_gpu == [(1, "nccl"), (2, "gloo")]


_TWO_RANKS_ONE_GPU = """
import os, torch, torch.distributed as dist
torch.cuda.set_device(0)  # both ranks on the same GPU
dist.init_process_group("nccl")
x = torch.ones(1, device="cuda")
dist.all_reduce(x)
torch.cuda.synchronize()
print("all_reduce returned", x.item(), flush=True)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nccl_itself_refuses_two_ranks_on_one_gpu(tmp_path):
    """Why the runtime refuses: NCCL will not put two ranks of one communicator on one GPU
    ('Duplicate GPU detected'). If this ever passes an all-reduce, the refusal can be relaxed."""
    script = tmp_path / "two_on_one.py"
    script.write_text(_TWO_RANKS_ONE_GPU)
    env = os.environ | {
        "CUDA_VISIBLE_DEVICES": (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.Popen(
        [*cmd, str(script)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail("two nccl ranks on one GPU hung instead of failing:\n" + out[-2000:])
    assert proc.returncode != 0, out[-2000:]
    assert "all_reduce returned" not in out
    assert "Duplicate GPU" in out or "ncclInvalidUsage" in out, json.dumps(out[-2000:])
