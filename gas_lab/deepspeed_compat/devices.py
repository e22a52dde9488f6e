"""Where a rank runs, found as ``deepspeed.initialize`` finds it: the model's device, and
``deepspeed.comm`` set up on the process group that exists."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def set_up_deepspeed_comm(distributed_port: int, dist_init_required) -> None:
    """``deepspeed.initialize`` leaves ``deepspeed.comm`` ready (``deepspeed.comm.get_rank()``
    works after it); so does gas_lab's, on the process group that exists, where DeepSpeed is
    installed."""
    backend = dist.get_backend()
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if backend == "nccl" else "cpu")
    try:
        from deepspeed import comm
    except ImportError:  # nothing written for DeepSpeed runs here then
        return
    comm.init_distributed(
        dist_backend=backend,
        distributed_port=distributed_port,
        dist_init_required=dist_init_required,
        verbose=False,
    )


def device_for(group, module) -> torch.device:
    """Where DeepSpeed puts the model: this rank's GPU when the group runs on nccl; otherwise
    gas_lab leaves it where it is (DeepSpeed's CPU accelerator: the CPU)."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return device_of(module)


def device_of(module) -> torch.device:
    return next((p.device for p in module.parameters()), torch.device("cpu"))
