"""Loops that measure the distributed pitfalls of lessons 02-04, and the reference they miss.

Every function here runs on *every* rank (inside ``cluster.run``) unless it says otherwise, and
uses the deterministic data of :mod:`gas_lab.parity`: ``micro_batch(seed, step, micro, rank,
size)``, so any process can rebuild what every rank saw.

* :func:`reference_params`: the answer a loop should reach: one process, one model, every
  rank's micro-batches of a step in one per-sample mean, one optimizer step per step.
* :func:`ddp_train`: ``torch.nn.parallel.DistributedDataParallel`` with ``no_sync()`` wrapped
  around the forward and backward, around the backward only, or not used, counted.
* :func:`global_count`: the fix for ranks that run different numbers of micro-batches.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from gas_lab.comm import count_collectives
from gas_lab.config import load_config
from gas_lab.parity import micro_batch, micro_batches_in, tiny_model

#: Where ``no_sync()`` goes in :func:`ddp_train`: around forward *and* backward (as torch's docs
#: ask), around the backward only (the trap), or nowhere (plain DDP: reduce every micro-batch).
PLACEMENTS = ("forward_and_backward", "backward_only", "none")


def flat(module: torch.nn.Module) -> torch.Tensor:
    """All parameters of ``module`` as one detached 1-D tensor (easy to compare and ship)."""
    return torch.cat([p.detach().flatten() for p in module.parameters()]).clone()


def reference_params(
    config: dict,
    steps: int,
    micro_batches: Sequence[int] | Callable[[int, int], int] | None = None,
    world_size: int = 2,
    clip: float = 0.0,
    seed: int = 0,
    grad_norms: list[float] | None = None,
) -> torch.Tensor:
    """Single process, no engine: the parameters a correct loop ends with (returned flat).

    Each step takes every micro-batch every rank would run (``micro_batches`` as in
    ``parity.train``), averages the loss over all of their samples (every sample weighs the
    same), clips at ``clip`` if it is > 0, and takes one step of the optimizer the config
    names (built as DeepSpeed builds it: type "Adam" is AdamW). Runs anywhere; no collectives.
    If ``grad_norms`` is a list, each step's gradient norm (before clipping) is appended to it.
    """
    cfg = load_config(config, world_size=world_size)
    model = tiny_model(seed)
    optimizer = cfg.optimizer.torch_optimizer(model.parameters())
    size = cfg.train_micro_batch_size_per_gpu
    for step in range(steps):
        pairs = [
            micro_batch(seed, step, m, rank, size)
            for rank in range(world_size)
            for m in range(
                micro_batches_in(micro_batches, step, rank, cfg.gradient_accumulation_steps)
            )
        ]
        if not pairs:
            # No data anywhere: the engines still step, with zero gradients.
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        else:
            x, y = (torch.cat(t) for t in zip(*pairs, strict=True))
            torch.nn.functional.mse_loss(model(x), y).backward()
        # max_norm inf: only measure. torch's clip scales by max_norm / (norm + 1e-6), as DeepSpeed.
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else math.inf)
        if grad_norms is not None:
            grad_norms.append(norm.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return flat(model)


def ddp_train(placement: str, n: int, steps: int, lr: float = 0.1, seed: int = 0) -> dict:
    """Train ``parity.tiny_model`` with torch's DDP, ``n`` micro-batches per step, SGD.

    ``placement`` (one of :data:`PLACEMENTS`) says what ``no_sync()`` wraps for the first
    ``n - 1`` micro-batches. Returns this rank's flat parameters and the loop's collectives.

    DDP's reducer calls the process group from C++, where :mod:`gas_lab.comm` cannot see it;
    registering torch's stock ``allreduce_hook`` (what DDP does anyway: divide by the world
    size, all-reduce) sends each bucket through ``torch.distributed.all_reduce``, which it can.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    if placement not in PLACEMENTS:
        raise ValueError(f"placement {placement!r}: choose from {PLACEMENTS}")
    rank = dist.get_rank()
    model = tiny_model(seed)
    ddp = DDP(model)
    ddp.register_comm_hook(None, allreduce_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    with count_collectives() as log:
        for step in range(steps):
            for m in range(n):
                x, y = micro_batch(seed, step, m, rank, 2)
                skip = m < n - 1 and placement != "none"  # the last one always syncs
                wrap_all = skip and placement == "forward_and_backward"
                wrap_backward = skip and placement == "backward_only"
                with ddp.no_sync() if wrap_all else contextlib.nullcontext():
                    loss = torch.nn.functional.mse_loss(ddp(x), y) / n
                    with ddp.no_sync() if wrap_backward else contextlib.nullcontext():
                        loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return {"params": flat(model), "calls": log.count("all_reduce"), "bytes": log.total_bytes()}


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
