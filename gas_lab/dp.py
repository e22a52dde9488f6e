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
3. :class:`AllReduceUpdate` is what ``gas_lab.engine`` uses at ZeRO stage 0, shaped like
   DeepSpeed's: gradients reduced in large buckets, then clipped by their global norm, then
   one optimizer step. The engine decides *when* (the accumulation boundary); this decides how.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def default_group():
    """The default process group if one exists, else None (a single process)."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def broadcast_parameters(module: torch.nn.Module, group=None) -> None:
    """Copy rank 0's weights to every rank, so all replicas start equal."""
    if group is None:
        return
    src = dist.get_global_rank(group, 0)
    for p in module.parameters():
        dist.broadcast(p.data, src=src, group=group)


# DeepSpeed's stage-0 bucket, in elements: a small model's gradients fit in one all-reduce.
ALLREDUCE_BUCKET_ELEMENTS = 500_000_000


def all_reduce_mean(tensors: list[torch.Tensor], group=None) -> None:
    """Replace each tensor by its average over ranks, with a single all-reduce.

    Flattening into one buffer sends one message instead of one per tensor: on a real network
    each message pays a fixed latency, so fewer, larger messages are cheaper.
    """
    if group is None or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)  # sum over ranks ...
    flat.mul_(1.0 / dist.get_world_size(group))  # ... then divide: the mean (as DeepSpeed)
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


class AllReduceUpdate:
    """Step 3, ZeRO stage 0: every rank keeps all the weights and the whole optimizer state.

    ``reduce_gradients()`` averages the gradients over ranks, one all-reduce per bucket;
    ``update()`` clips, steps the optimizer and clears the gradients, identically on every rank,
    which keeps the replicas equal. (``gas_lab.engine.UpdateStrategy`` is the interface.)
    """

    def __init__(self, params, optimizer, group, config):
        # Frozen and empty parameters have nothing to reduce (DeepSpeed skips them too).
        self.params = [p for p in params if p.requires_grad and p.numel() > 0]
        self.optimizer = optimizer
        self.group = group
        self.max_norm = config.gradient_clipping

    def reduce_gradients(self) -> None:
        for p in self.params:
            if p.grad is None:
                # A parameter unused on this rank still joins the collective: every rank must
                # reduce buffers of the same layout, or the all-reduce mixes up tensors.
                p.grad = torch.zeros_like(p)
        for bucket in _buckets([p.grad for p in self.params], ALLREDUCE_BUCKET_ELEMENTS):
            all_reduce_mean(bucket, self.group)

    def update(self) -> bool:
        if self.max_norm > 0:
            clip_by_global_norm(self.params, self.max_norm, self.group)
        self.optimizer.step()
        for p in self.params:
            p.grad = None  # the next step accumulates from scratch
        return True


def _buckets(grads, max_elements):
    """Group gradients by dtype, then into buckets that close once they exceed max_elements."""
    by_dtype: dict[torch.dtype, list] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same_dtype in by_dtype.values():
        bucket, size = [], 0
        for g in same_dtype:
            bucket.append(g)
            size += g.numel()
            if size > max_elements:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket


def clip_by_global_norm(params, max_norm: float, group=None) -> torch.Tensor:
    """Scale all gradients by min(1, max_norm / (norm + 1e-6)), the norm taken over *all* of them.

    Called after the reduction, so the norm is that of the averaged gradient, the same on every
    rank. DeepSpeed still averages the norm over ranks with a (4-byte) all-reduce, because with
    expert-parallel layers the ranks' norms differ; gas_lab does the same, so the collective
    counts match DeepSpeed's.
    """
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.stack([g.detach().float().norm(2) for g in grads]).pow(2).sum().pow(0.5)
    if group is not None:
        norm = norm / float(dist.get_world_size(group))
        dist.all_reduce(norm, group=group)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return norm
