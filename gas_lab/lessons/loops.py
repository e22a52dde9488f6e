"""Loops the lessons measure, beyond the engine's own (lesson 02).

Every function here runs on *every* rank (inside ``cluster.run``) and uses the deterministic
data of :mod:`gas_lab.toys`, so any process can rebuild what every rank saw. The answer
such a loop should reach is :func:`gas_lab.measure.parity.reference_params`.

* :func:`ddp_train`: ``torch.nn.parallel.DistributedDataParallel`` with ``no_sync()`` wrapped
  around the forward and backward, around the backward only, or not used (:func:`ddp_steps`),
  counted and timed.
* :func:`equal_n_train` (lesson 09): unmanaged accumulation where ranks have different numbers
  of micro-batches, made safe for ZeRO-2/3: every rank runs as many ``backward()`` calls as the
  busiest one, the extra ones with weight 0.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from gas_lab.measure.comm import count_collectives
from gas_lab.measure.parity import quiet_deepspeed
from gas_lab.measure.recording import collectives, record_loop
from gas_lab.toys import flat_params, micro_batch, tiny_model

#: Where ``no_sync()`` goes in :func:`ddp_train`: around forward *and* backward (as torch's docs
#: ask), around the backward only (the trap), or nowhere (plain DDP: reduce every micro-batch).
PLACEMENTS = ("forward_and_backward", "backward_only", "none")


def ddp_train(placement: str, n: int, steps: int, lr: float = 0.1, seed: int = 0) -> dict:
    """Train ``tiny_model`` with torch's DDP and SGD, :func:`ddp_steps` recorded; return this
    rank's parameters, the loop's all-reduces (calls, bytes) and its timeline ``events``."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    if placement not in PLACEMENTS:
        raise ValueError(f"placement {placement!r}: choose from {PLACEMENTS}")
    model = tiny_model(seed)
    ddp = DDP(model)
    # DDP all-reduces from C++, out of a recorder's sight; its stock hook (divide by the world
    # size, all-reduce) goes through torch.distributed.all_reduce, where a recorder sees it.
    ddp.register_comm_hook(None, allreduce_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    with record_loop(ddp, optimizer) as events:
        ddp_steps(ddp, optimizer, placement, n, steps, seed)
    reduces = [e for e in collectives(events) if e.kind == "all_reduce"]
    return {
        "params": flat_params(model),
        "calls": len(reduces),
        "bytes": sum(e.bytes for e in reduces),
        "events": events,
    }


def ddp_steps(ddp, optimizer, placement: str, n: int, steps: int, seed: int = 0) -> None:
    """``steps`` optimizer steps of ``n`` micro-batches each; ``no_sync()`` wraps what
    ``placement`` says for all but the last micro-batch of a step."""
    rank = dist.get_rank()
    for step in range(steps):
        for m in range(n):
            x, y = micro_batch(seed, step, m, rank, 2)  # rank's own m-th micro-batch
            skip = m < n - 1 and placement != "none"  # the last one always syncs
            wrap_all = skip and placement == "forward_and_backward"
            wrap_backward = skip and placement == "backward_only"
            with ddp.no_sync() if wrap_all else contextlib.nullcontext():
                loss = torch.nn.functional.mse_loss(ddp(x), y) / n
                with ddp.no_sync() if wrap_backward else contextlib.nullcontext():
                    loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def mean_weight(real: bool, n: int, total: int, world: int) -> float:
    """The weight of a micro-batch's loss in :func:`equal_n_train`: ``W / total`` for a real
    one (DeepSpeed then averages over the W ranks: 1 / total each), 0 for padding."""
    return world / total if real else 0.0


def equal_n_train(
    initialize, config: dict, steps: int, micro_batches, seed: int = 0, weight=mean_weight
):
    """Unmanaged training where rank r has ``micro_batches(step, r)`` micro-batches (0: idle).

    ZeRO-2/3 reduce in every ``backward()``, so every rank must call it equally often: the
    ranks first share their counts (one small all-gather), then each runs ``max`` of them; a
    rank's extra micro-batches repeat a real one's shape with weight 0, so they add nothing.
    ``weight`` (:func:`mean_weight`) makes every real micro-batch weigh the same: the step's
    update is the mean over all its micro-batches, what
    :func:`gas_lab.measure.parity.reference_params` computes.
    Returns ``(engine, CollectiveLog of the loop)``.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_model(seed)
    engine = initialize(model=model, model_parameters=model.parameters(), config=config)[0]
    size = engine.train_micro_batch_size_per_gpu()
    with count_collectives() as log, quiet_deepspeed():
        for step in range(steps):
            n = micro_batches(step, rank)
            counts = torch.empty(world, dtype=torch.int64)
            dist.all_gather_into_tensor(counts, torch.tensor([n]))
            longest, total = int(counts.max()), int(counts.sum())
            for micro in range(longest):
                real = micro < n  # padding repeats a real micro-batch, weighed 0
                x, y = micro_batch(seed, step, micro if real else 0, rank, size)
                loss = torch.nn.functional.mse_loss(engine(x), y)
                engine.backward(loss * weight(real, n, total, world), scale_wrt_gas=False)
            engine.step()
    return engine, log
