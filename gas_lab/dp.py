"""Data parallelism from scratch, in two steps.

Every rank holds a full copy of the model and sees different data. After backward(), each rank
has the gradient of *its* data; averaging the gradients over ranks (an all-reduce, then a
division by the world size) gives every rank the gradient of *all* the data, so the same
optimizer step keeps the copies identical.

1. :class:`NaiveDataParallel` averages after every backward(): with gradient accumulation over
   N micro-batches that is N all-reduces per optimizer step, N-1 of them wasted, because
   averaging is linear: reducing the sum once gives the same result as summing the reductions.
2. :class:`NoSyncDataParallel` adds ``no_sync()``: inside it backward() only accumulates
   locally; the last micro-batch's backward(), outside it, reduces once. 1 all-reduce per step.

Taught in lesson 02 (``tutorials/02_ddp.ipynb``). The pieces every data-parallel loop of the
course shares live here too: the process group (:func:`init_from_env`, :func:`default_group`),
:func:`broadcast_parameters`, :func:`all_reduce_mean`, :func:`global_count` (a count over all
ranks, lesson 04) and clipping by the norm of the whole gradient (:func:`global_norm`,
:func:`clip_by_norm`). Stage 0's update at the boundary, built from them, is
:class:`gas_lab.engine.AllReduce`.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist


def init_from_env(init_method: str = "env://", timeout_s: float = 120.0) -> str:
    """Join the default process group the way ``torchrun`` scripts do; returns the backend.

    One process per GPU with nccl where CUDA exists; otherwise gloo on the CPU, with
    ``DS_ACCELERATOR=cpu`` so DeepSpeed does not look for a GPU. Ranks come from ``RANK`` and
    ``WORLD_SIZE``; a plain ``python`` process (no ``RANK``) gets a group of one, because
    DeepSpeed needs a group even alone. Sets the launcher variables DeepSpeed reads.
    """
    if torch.cuda.is_available():
        backend = "nccl"
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        backend = "gloo"
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if backend == "nccl" else "cpu")
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if "RANK" in os.environ:
            dist.init_process_group(
                backend,
                init_method=init_method,
                rank=int(os.environ["RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]),
                timeout=timeout,
            )
        else:
            store = dist.HashStore()
            dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timeout)
    # DeepSpeed reads the launcher's variables even when the group already exists.
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank() % max(torch.cuda.device_count(), 1)))
    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    return dist.get_backend()


def end_rank() -> None:
    """The last line of a script a launcher started: leave the process group and end the process
    at once, exit status 0.

    After all work is done, the interpreter's own teardown sometimes aborts with "terminate
    called without an active exception" (a C++ helper thread that torch or DeepSpeed started is
    still running when it is destroyed; about 1 run in 8 of tutorial 00's script on 2 CPU
    ranks), and ``torchrun`` then reports the rank as failed. Nothing is left to tear down that
    matters, so the teardown is skipped.
    """
    import sys

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def default_group():
    """The data-parallel process group gas_lab's engine uses, found as DeepSpeed finds it.

    The default group if one exists; else one started from torchrun's ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; else None (a single process: no
    collectives at all).
    """
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    if {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
        init_from_env()
        return dist.group.WORLD
    return None


def broadcast_parameters(module: torch.nn.Module, group=None) -> None:
    """Copy rank 0's weights to every rank, so all replicas start equal."""
    if group is None:
        return
    src = dist.get_global_rank(group, 0)
    for p in module.parameters():
        dist.broadcast(p.data, src=src, group=group)


def all_reduce_mean(tensors: list[torch.Tensor], group=None) -> None:
    """Replace each tensor by its average over ranks, with a single all-reduce.

    Flattening into one buffer sends one message instead of one per tensor: on a real network
    each message pays a fixed latency, so fewer, larger messages are cheaper.
    """
    if group is None or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)  # sum over ranks ...
    flat.mul_(1.0 / dist.get_world_size(group))  # ... then divide: the mean
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


class NaiveDataParallel(torch.nn.Module):
    """Step 1: all-reduce the gradients after every backward()."""

    def __init__(self, module: torch.nn.Module, group=None):
        super().__init__()
        self.module = module
        self.group = group if group is not None else default_group()
        broadcast_parameters(module, self.group)

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.sync_gradients()

    def sync_gradients(self) -> None:
        params = [p for p in self.module.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # every rank must send the same buffer layout
                p.grad = torch.zeros_like(p)
        all_reduce_mean([p.grad for p in params], self.group)


class NoSyncDataParallel(NaiveDataParallel):
    """Step 2: ``with model.no_sync():`` skips the all-reduce; the next backward() outside it
    reduces everything accumulated so far, once."""

    def __init__(self, module: torch.nn.Module, group=None):
        super().__init__(module, group)
        self.require_backward_grad_sync = True  # the name torch's DDP uses for the same flag

    @contextlib.contextmanager
    def no_sync(self):
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self.require_backward_grad_sync:
            self.sync_gradients()


def train_step(model, optimizer, micro_batches, loss_fn) -> float:
    """One optimizer step over a list of (x, y) micro-batches; returns the mean loss.

    Each micro-batch loss is divided by the number of micro-batches so the accumulated gradient
    is the gradient of the mean over all of them. With a NoSyncDataParallel model, all but the
    last backward() run inside no_sync().
    """
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        skip_sync = not last and hasattr(model, "no_sync")
        with model.no_sync() if skip_sync else contextlib.nullcontext():
            loss = loss_fn(model(x), y) / len(micro_batches)
            model.backward(loss)
        total += loss.item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def global_count(local: int | float, group=None) -> float:
    """The sum of ``local`` over all ranks (one 8-byte all-reduce), the same on every rank.

    Call it *before* the first backward of a step: to weigh every micro-batch (or sample) the
    same, each rank must divide by a number that counts every rank's data, not just its own.
    """
    on_gpu = dist.is_initialized() and dist.get_backend(group) == "nccl"  # nccl: GPU tensors only
    device = f"cuda:{torch.cuda.current_device()}" if on_gpu else "cpu"
    total = torch.tensor([float(local)], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(total, group=group)
    return total.item()


def global_norm(grads: list[torch.Tensor], group=None) -> torch.Tensor:
    """The L2 norm of the whole gradient; with ``group``, each rank holds only a part of it
    (ZeRO's shards, lesson 05), and the parts' squared norms are summed over ranks.

    Norms do not add, squares do: sum the squared norms, then take the root. (The root of a
    local part alone would be this rank's part, smaller than the true norm.)
    """
    device = grads[0].device if grads else None
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        squares = squares + g.detach().float().pow(2).sum()
    if group is not None:
        dist.all_reduce(squares, group=group)  # 4 bytes: sum over ranks
    return squares.sqrt()


def clip_by_norm(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Clipping, the one function every stage uses: scale ``grads`` in place by
    ``min(1, max_norm / (norm + 1e-6))``, where ``norm`` is the norm of the *whole* gradient
    (torch's and DeepSpeed's formula). Clipping sees the accumulated gradient, once per step."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
