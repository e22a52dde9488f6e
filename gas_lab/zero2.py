"""ZeRO stage 2 from scratch: the gradients are partitioned too, so they move in every backward().

ZeRO-1 (:mod:`gas_lab.zero1`) shards the optimizer state but keeps every rank's whole gradient
until the boundary. ZeRO-2 also shards the *gradients*: rank r keeps only the gradient of its
own partition of the flat vector. A gradient it does not own cannot wait for the boundary on
rank r, so it is reduced while ``backward()`` runs and then dropped. What happens when:

1. **every backward()**, managed *and* unmanaged: as autograd finishes a parameter's gradient, a
   hook puts the parameter in a bucket; a bucket that would grow past ``reduce_bucket_size``
   elements is reduced first, and the end of ``backward()`` reduces the rest. Reducing a
   bucket: divide by W, sum it over ranks with one all-reduce (DeepSpeed 0.19.8's choice on
   this path, measured in lesson 09; a reduce-scatter would deliver only the owned slices),
   then add the slices this rank owns into its fp32 partition of the accumulated gradient.
   Every other gradient is freed: ``param.grad`` is None after every backward().
2. **the boundary** (managed: the GAS-th backward(); unmanaged: ``step()``) has nothing left to
   reduce: the accumulated partition is the averaged gradient.
3. **update**: the global norm (one 4-byte all-reduce), clipping, the optimizer step on this
   rank's partition, and one all-gather of the updated weights, exactly as at ZeRO-1.

So N micro-batches cost N gradient reductions per optimizer step, managed or not; unmanaged
accumulation at ZeRO-1 costs one. And every rank must run the same number of backward() calls:
the k-th reduction of one rank pairs with the k-th of the others.

Taught in lesson 09 (``tutorials/09_beyond_zero1.ipynb``), which checks it against DeepSpeed
stage 2 bit for bit; DeepSpeed's norm, packing and coalescing are added on top, in
:mod:`gas_lab.deepspeed_compat.zero`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gas_lab.zero1 import ShardedUpdate


class PartitionedGradientUpdate(ShardedUpdate):
    """ZeRO-2 as the engine's strategy (:class:`gas_lab.engine.Engine`): reduces from gradient
    hooks during every backward() (the engine calls :meth:`after_backward` at its end), has
    nothing left to do at the boundary (:meth:`reduce_gradients`), then ZeRO-1's
    :meth:`~gas_lab.zero1.ShardedUpdate.update`, unchanged.

    ``bucket_size``: elements per bucket (DeepSpeed's ``reduce_bucket_size``). fp32 only.
    Frozen and empty parameters are left out; a parameter without a gradient on this rank is
    left out of the bucket, as in DeepSpeed (so its ranks must agree on which parameters got
    one).
    """

    def __init__(
        self, params, optimizer, group=None, max_norm: float = 0.0, bucket_size: int = 500_000_000
    ):
        super().__init__(params, optimizer, group, max_norm)  # ZeRO-1's flat groups and shards
        self.bucket_size = bucket_size
        # This rank's partition of the accumulated, rank-averaged gradient: all it keeps
        # (allocated by the first reduction after an update, freed by the update).
        self.accumulated: list[torch.Tensor] | None = None
        # id(param) -> (group index, offset in the flat vector, [(owner, start, numel), ...])
        self._slices = {}
        for gi, g in enumerate(self.groups):
            for p, offset in zip(g.params, g.layout.offsets, strict=True):
                owned = _owned_slices(offset, p.numel(), g.layout.shard_size)
                self._slices[id(p)] = (gi, offset, owned)
        self.bucket: list[torch.nn.Parameter] = []
        self.bucket_numel = 0
        self._hooks = [
            p.register_post_accumulate_grad_hook(self.gradient_ready)
            for g in self.groups
            for p in g.params
        ]

    # -- every backward() ------------------------------------------------------------------------
    def gradient_ready(self, param) -> None:
        """Autograd finished ``param.grad`` for this backward pass: bucket it."""
        self.add_to_bucket(param)

    def add_to_bucket(self, param) -> None:
        """Queue ``param.grad`` for reduction; reduce the bucket first if it would overflow."""
        if self.bucket_numel + param.numel() > self.bucket_size:
            self.reduce_bucket()  # full: reduce what is there before adding more
        self.bucket.append(param)
        self.bucket_numel += param.numel()

    def after_backward(self) -> None:
        """The end of a backward pass: reduce what is left in the bucket."""
        self.reduce_bucket()

    def reduce_bucket(self) -> None:
        """Average the bucket's gradients over ranks, keep this rank's slices, free the rest."""
        if not self.bucket:
            return
        grads = torch.cat([p.grad.reshape(-1) for p in self.bucket])
        self.average_over_ranks(grads)
        if self.accumulated is None:
            self.accumulated = [torch.zeros_like(g.master) for g in self.groups]
        position = 0  # where the parameter starts in grads
        for p in self.bucket:
            gi, offset, owned = self._slices[id(p)]
            for owner, start, numel in owned:
                if owner == self.rank:  # this rank's slice: into its partition
                    to = offset + start - self.groups[gi].start
                    mine = grads[position + start : position + start + numel]
                    self.accumulated[gi][to : to + numel].add_(mine)
            position += p.numel()
        for p in self.bucket:
            p.grad = None  # reduced, and this rank's part kept: the full gradient goes
        self.bucket, self.bucket_numel = [], 0

    def average_over_ranks(self, grads: torch.Tensor) -> None:
        """One all-reduce of the whole bucket, divided by W first (DeepSpeed's order)."""
        grads.div_(self.world_size)
        if self.group is not None:
            dist.all_reduce(grads, group=self.group)

    # -- the boundary ----------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """Nothing left: every backward() reduced its gradients."""

    def gradient_shards(self) -> list[torch.Tensor]:
        """The accumulated partitions, as the master shards' gradients."""
        if self.accumulated is None:  # no backward() since the last update: zero gradients
            self.accumulated = [torch.zeros_like(g.master) for g in self.groups]
        for g, acc in zip(self.groups, self.accumulated, strict=True):
            g.master.grad = acc
        return self.accumulated

    def clear(self) -> None:
        super().clear()
        self.accumulated = None


def _owned_slices(offset: int, numel: int, shard_size: int) -> list[tuple[int, int, int]]:
    """Cut the parameter at ``[offset, offset + numel)`` of the flat vector at partition
    boundaries: ``(owning rank, start in the parameter, numel)`` for each piece, in order."""
    out, start = [], 0
    while start < numel:
        owner = (offset + start) // shard_size
        end = min(numel, (owner + 1) * shard_size - offset)
        out.append((owner, start, end - start))
        start = end
    return out
