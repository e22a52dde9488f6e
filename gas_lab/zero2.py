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
   reduce: the accumulated partition is the averaged gradient. (Inside
   ``coalesce_grad_reduction()`` the gradients stay local, and the boundary reduces them once.)
3. **update**: the global norm (per-piece norms in float64, as DeepSpeed does, one 4-byte
   all-reduce), clipping, the optimizer step on this rank's partition, and one all-gather of
   the updated weights, exactly as at ZeRO-1.

So N micro-batches cost N gradient reductions per optimizer step, managed or not; unmanaged
accumulation at ZeRO-1 costs one. And every rank must run the same number of backward() calls:
the k-th reduction of one rank pairs with the k-th of the others.

Taught in lesson 09 (``tutorials/09_beyond_zero1.ipynb``), which checks it against DeepSpeed
stage 2 bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gas_lab.dp import clip_by_norm
from gas_lab.zero1 import flat_groups


class PartitionedGradientUpdate:
    """ZeRO-2 as the engine's strategy (:class:`gas_lab.engine.Engine`): reduces from gradient
    hooks during every backward() (the engine calls :meth:`after_backward` at its end), has
    nothing left to do at the boundary (:meth:`reduce_gradients`), then :meth:`update` as at
    ZeRO-1.

    ``bucket_size``: elements per bucket (DeepSpeed's ``reduce_bucket_size``, the plan it is
    given); ``average`` False sums over ranks. fp32 only (the rules refuse bf16 at stage 2 as
    out of gas_lab's scope). Frozen and empty parameters are left out; a parameter without a
    gradient on this rank is left out of the bucket, as in DeepSpeed (so its ranks must agree
    on which parameters got one).
    """

    def __init__(self, params, optimizer, group=None, max_norm: float = 0.0,
                 bucket_size: int = 500_000_000, average: bool = True):  # fmt: skip
        self.group, self.max_norm, self.average = group, max_norm, average
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.bucket_size = bucket_size
        self.groups = flat_groups(params, optimizer, self.world_size, self.rank)
        self.optimizer = optimizer
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
        self.deferred = False  # inside coalesce_grad_reduction(): gradients stay local
        self.last_norm: float | None = None
        self._hooks = [
            p.register_post_accumulate_grad_hook(self.gradient_ready)
            for g in self.groups
            for p in g.params
        ]

    # -- every backward() ------------------------------------------------------------------------
    def gradient_ready(self, param) -> None:
        """Autograd finished ``param.grad`` for this backward pass: bucket it."""
        if not self.deferred:
            self.add_to_bucket(param)

    def add_to_bucket(self, param) -> None:
        """Queue ``param.grad`` for reduction; reduce the bucket first if it would overflow."""
        if self.bucket_numel + param.numel() > self.bucket_size:
            self.reduce_bucket()  # full: reduce what is there before adding more
        self.bucket.append(param)
        self.bucket_numel += param.numel()

    def after_backward(self) -> None:
        """The end of a backward pass: reduce what is left in the bucket."""
        if not self.deferred:
            self.reduce_bucket()

    def defer_reduction(self, deferred: bool) -> None:
        """The engine's ``coalesce_grad_reduction()``: keep gradients local while True."""
        self.deferred = deferred

    def reduce_bucket(self) -> None:
        """Average the bucket's gradients over ranks, keep this rank's slices, free the rest."""
        if not self.bucket:
            return
        grads = torch.cat([p.grad.reshape(-1) for p in self.bucket])
        if self.average:
            grads.div_(self.world_size)  # divide first, then sum: DeepSpeed's order
        # Each parameter's slices, (where in grads, numel), and those this rank owns.
        slices, mine, position = [], [], 0
        for p in self.bucket:
            gi, offset, owned = self._slices[id(p)]
            for owner, start, numel in owned:
                slices.append((position + start, numel))
                if owner == self.rank:  # (group, where in grads, where in my partition, numel)
                    mine.append(
                        (gi, position + start, offset + start - self.groups[gi].start, numel)
                    )
            position += p.numel()
        self._all_reduce_in_packs(grads, slices)
        if self.accumulated is None:
            self.accumulated = [torch.zeros_like(g.master) for g in self.groups]
        for gi, at, to, numel in mine:
            self.accumulated[gi][to : to + numel].add_(grads[at : at + numel])
        for p in self.bucket:
            p.grad = None  # reduced, and this rank's part kept: the full gradient goes
        self.bucket, self.bucket_numel = [], 0

    def _all_reduce_in_packs(self, grads: torch.Tensor, slices: list) -> None:
        """Sum the slices over ranks, packed: a pack closes once it exceeds the bucket size.

        A bucket holds at most ``reduce_bucket_size`` elements, so it is one pack, one
        all-reduce; only a parameter larger than that (alone in its bucket) may be cut into
        one all-reduce per partition it spans.
        """
        if self.group is None:
            return
        pack, size = [], 0
        for index, (start, numel) in enumerate(slices):
            pack.append((start, numel))
            size += numel
            if size > self.bucket_size or index == len(slices) - 1:
                packed = torch.cat([grads[s : s + n] for s, n in pack])
                dist.all_reduce(packed, group=self.group)
                done = 0
                for s, n in pack:  # copied back whole; each rank then reads its own slices
                    grads[s : s + n].copy_(packed[done : done + n])
                    done += n
                pack, size = [], 0

    # -- the boundary ----------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """At the boundary: gradients kept local (coalescing) are reduced now, in model order."""
        held = [p for g in self.groups for p in g.params if p.grad is not None]
        for p in held:
            self.add_to_bucket(p)
        self.reduce_bucket()

    def update(self) -> bool:
        """Global norm, clip, step this rank's partition, all-gather the weights."""
        if self.accumulated is None:  # no backward() since the last update: zero gradients
            self.accumulated = [torch.zeros_like(g.master) for g in self.groups]
        norm = self.global_norm()
        self.last_norm = norm.item()
        if not torch.isfinite(norm):  # DeepSpeed's ZeRO skips an fp32 update on inf/nan too
            self._clear()
            return False
        for g, acc in zip(self.groups, self.accumulated, strict=True):
            g.master.grad = acc
        if self.max_norm > 0:
            clip_by_norm(self.accumulated, norm, self.max_norm, reciprocal=True)
        self.optimizer.step()
        self._clear()
        for g in self.groups:
            if self.group is None:
                g.flat.copy_(g.master.detach())
            else:
                dist.all_gather_into_tensor(g.flat, g.master.detach(), group=self.group)
        return True

    def global_norm(self) -> torch.Tensor:
        """Per group: the squared float64 norms of this rank's pieces, summed in float32 over
        ranks (one 4-byte all-reduce per group); the groups' norms combined as a vector."""
        norms = []
        for g, acc in zip(self.groups, self.accumulated, strict=True):
            pieces = [
                acc[g.layout.offsets[i] + lo - g.start : g.layout.offsets[i] + hi - g.start]
                for i, lo, hi in g.layout.pieces(self.rank)
            ]
            if pieces:
                piece_norms = [torch.linalg.vector_norm(x.double()) for x in pieces]
                squares = torch.stack(piece_norms).pow(2.0).sum().float()
            else:
                squares = torch.zeros((), dtype=torch.float32)
            if self.group is not None:
                dist.all_reduce(squares, group=self.group)
            norms.append(squares.pow(0.5))
        if not norms:
            return torch.zeros(())
        return torch.linalg.vector_norm(torch.stack(norms))

    def _clear(self) -> None:
        for g in self.groups:
            g.master.grad = None
            g.clear_grads()
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
