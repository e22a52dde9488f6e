"""ZeRO-1 and ZeRO-2 as DeepSpeed 0.19.8 runs them: the floor's strategies
(:class:`gas_lab.zero1.ShardedUpdate`, :class:`gas_lab.zero2.PartitionedGradientUpdate`) with
what only matching DeepSpeed needs.

* ZeRO-1 (:class:`Zero1`): DeepSpeed's bucket ``plan`` (:class:`.buckets.Zero1Plan`: its
  collectives and its order of the parameters in the flat vector), the ``precision``
  (:class:`.precision.Precision`: bf16 weights, the accumulation and communication dtypes),
  ``"gradient_allreduce_op": "sum"``, and the global norm at every update, reported and
  checked for inf/nan.
* ZeRO-2 (:class:`Zero2`): ``"sum"``, DeepSpeed's packing of a parameter larger than a bucket,
  ``coalesce_grad_reduction()``, and its norm and clipping, rounded as DeepSpeed rounds them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gas_lab.deepspeed_compat import buckets
from gas_lab.deepspeed_compat.norms import clip_by_reciprocal
from gas_lab.dp import clip_by_norm, global_norm
from gas_lab.zero1 import ShardedUpdate, _FlatGroup, gather_weights, renamed_collective
from gas_lab.zero2 import PartitionedGradientUpdate


class DeepSpeedUpdate:
    """The update of DeepSpeed's ZeRO optimizers, for :class:`Zero1` and :class:`Zero2`: the
    global norm (``norm_for_update``; None: not computed), reported (``last_norm``); an inf/nan
    norm skips the update (``skip_nonfinite``); then clip (``clip``), step and all-gather."""

    last_norm: float | None = None  # the global gradient norm of the last update
    skip_nonfinite = True

    def __init__(self, *args, average: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.average = average  # False: "gradient_allreduce_op": "sum", no division by W

    # What DeepSpeedEngine calls besides the floor's three (strategies.DeepSpeedStrategy):
    # nothing to do, unless a stage says otherwise below.
    def before_backward(self) -> None:
        """A backward pass starts."""

    def defer_reduction(self, deferred: bool) -> None:
        """Inside ``coalesce_grad_reduction()`` while True."""

    def destroy(self) -> None:
        """``engine.destroy()``."""

    def update(self) -> bool:
        shards = self.gradient_shards()
        norm = self.norm_for_update(shards)
        if norm is not None:
            self.last_norm = norm.item()
            if self.skip_nonfinite and not torch.isfinite(norm):
                self.clear()  # an inf/nan gradient: skip the update, weights untouched
                return False
            if self.max_norm > 0:
                self.clip(shards, norm)
        self.optimizer.step()
        self.clear()
        gather_weights(self.groups, self.group)
        return True


class Zero1(DeepSpeedUpdate, ShardedUpdate):
    """:class:`~gas_lab.zero1.ShardedUpdate` given DeepSpeed's ``plan`` (which replaces
    ``reduce``) and ``precision``; ``average`` False sums over ranks instead (lesson 08).
    Without a plan: lesson 05's ``reduce``, in the precision's communication dtype."""

    def __init__(
        self,
        params,
        optimizer,
        group=None,
        max_norm: float = 0.0,
        reduce: str = "all_reduce",
        *,
        average: bool = True,
        plan=None,
        precision=None,
    ):
        world = dist.get_world_size(group) if group is not None else 1
        originals = arrange(params, optimizer, world, plan.order if plan is not None else None)
        super().__init__(params, optimizer, group, max_norm, reduce, average=average)
        for g, original in zip(self.groups, originals, strict=True):
            set_walk(g, original)
        self.plan, self.precision = plan, precision
        self.comm_dtype = precision.communicate if precision is not None else None
        # A non-finite norm skips the update (DeepSpeed's ZeRO; its bf16 may check nothing).
        self.skip_nonfinite = precision.skip_nonfinite if precision is not None else True
        # bf16 + fp32 accumulation: every micro-batch's gradient goes into fp32 buffers.
        mine = [p for g in self.groups for p in g.params]
        self.buffers = precision.grad_buffers(mine) if precision is not None else None

    def before_backward(self) -> None:
        if self.buffers is not None:
            self.buffers.before_backward()

    def destroy(self) -> None:
        """Take off what ``strategies.expose_full_gradients`` attached to the parameters."""
        for p in (p for g in self.groups for p in g.params):
            for name in ("_hp_mapping", "get_full_hp_grad"):
                if name in vars(p):
                    delattr(p, name)

    def after_backward(self) -> None:
        if self.buffers is not None:
            self.buffers.after_backward()

    def local_gradient(self, g: _FlatGroup) -> torch.Tensor:
        if self.buffers is None:
            return super().local_gradient(g)
        index = {id(p): i for i, p in enumerate(self.buffers.params)}
        return g.local_gradient([self.buffers.buffers[index[id(p)]] for p in g.params])

    def reduce_gradients(self) -> None:
        if self.plan is None:
            super().reduce_gradients()
        else:  # DeepSpeed's buckets reduce every group at once
            locals_ = [self.local_gradient(g) for g in self.groups]
            self.plan.reduce(locals_, self.groups, self.group, self.comm_dtype)
            for g, local in zip(self.groups, locals_, strict=True):
                self.keep(g, local[g.start : g.end])
        if self.buffers is not None:
            self.buffers.clear()

    def reduce_shard(self, g: _FlatGroup, local: torch.Tensor) -> torch.Tensor:
        """Lesson 05's reductions, in the communication dtype, averaged or summed."""
        if self.reduce == "all_reduce":
            # Send only the real elements (DeepSpeed's buffer), pad afterwards to cut shards.
            real = local[: g.layout.numel].clone()
            mean = (lambda t: t.mul_(1.0 / self.world_size)) if self.average else None
            buckets.reduce_views([real], self.group, self.comm_dtype, steps=(None, mean))
            return torch.nn.functional.pad(real, (0, g.layout.padding))[g.start : g.end]
        if self.group is None:
            return local[g.start : g.end]
        comm = self.comm_dtype or local.dtype
        shard = torch.empty(g.layout.shard_size, dtype=comm, device=g.flat.device)
        with renamed_collective():
            dist.reduce_scatter_tensor(shard, local.to(comm), group=self.group)
        if self.average:
            shard.div_(self.world_size)
        return shard.to(local.dtype)

    def norm_for_update(self, shards: list[torch.Tensor]) -> torch.Tensor | None:
        # The norm at every update, clipping or not, as DeepSpeed (one 4-byte all-reduce);
        # only its plan's compute_grad_norm false, with clipping off, skips it.
        if self.plan is None or self.plan.compute_norm:
            return global_norm(shards, self.group)
        return None

    def clip(self, shards: list[torch.Tensor], norm: torch.Tensor) -> None:
        clip_by_norm(shards, norm, self.max_norm)

    def clear(self) -> None:
        super().clear()
        if self.buffers is not None:
            self.buffers.clear()


def arrange(params, optimizer, world_size: int, order=None) -> list[list]:
    """Put each param group's trainable parameters in DeepSpeed's order in the flat vector
    (``order(numels, world_size)``: ``round_robin_gradients``) before ZeRO-1 flattens them;
    returns each non-empty group's parameters in their own order."""
    trainable = {id(p) for p in params if p.requires_grad and p.numel() > 0}
    originals = []
    for param_group in optimizer.param_groups:
        mine = [p for p in param_group["params"] if id(p) in trainable]
        if mine:
            originals.append(mine)
            if order is not None:
                param_group["params"] = [
                    mine[i] for i in order([p.numel() for p in mine], world_size)
                ]
    return originals


def set_walk(g: _FlatGroup, original: list) -> None:
    """``g.walk``: (offset in the flat vector, numel) of each parameter in the group's own
    order, the order DeepSpeed buckets gradients in (:class:`.buckets.Zero1Plan`)."""
    offsets = {id(p): o for p, o in zip(g.params, g.layout.offsets, strict=True)}
    g.walk = [(offsets[id(p)], p.numel()) for p in original]


def arranged_group(params: list, world_size: int, rank: int, order=None) -> _FlatGroup:
    """One flat group in DeepSpeed's order, with its ``walk``."""
    numels = [p.numel() for p in params]
    ordered = params if order is None else [params[i] for i in order(numels, world_size)]
    g = _FlatGroup(ordered, world_size, rank)
    set_walk(g, params)
    return g


class Zero2(DeepSpeedUpdate, PartitionedGradientUpdate):
    """:class:`~gas_lab.zero2.PartitionedGradientUpdate` as DeepSpeed runs it: ``average``
    False sums over ranks; ``coalesce_grad_reduction()`` keeps gradients local
    (:meth:`defer_reduction`); the norm per piece in float64 and the clip factor rounded as
    DeepSpeed's ZeRO-2 optimizer rounds it; a non-finite norm skips the update."""

    deferred = False  # inside coalesce_grad_reduction(): gradients stay local

    def gradient_ready(self, param) -> None:
        if not self.deferred:
            super().gradient_ready(param)

    def after_backward(self) -> None:
        if not self.deferred:
            super().after_backward()

    def defer_reduction(self, deferred: bool) -> None:
        """The engine's ``coalesce_grad_reduction()``: keep gradients local while True."""
        self.deferred = deferred

    def average_over_ranks(self, grads: torch.Tensor) -> None:
        if self.average:
            grads.div_(self.world_size)  # divide first, then sum: DeepSpeed's order
        slices, position = [], 0  # each parameter's slices: (where in grads, numel)
        for p in self.bucket:
            _, _, owned = self._slices[id(p)]
            slices += [(position + start, numel) for _, start, numel in owned]
            position += p.numel()
        self._all_reduce_in_packs(grads, slices)

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

    def reduce_gradients(self) -> None:
        """At the boundary: gradients kept local (coalescing) are reduced now, in model order."""
        held = [p for g in self.groups for p in g.params if p.grad is not None]
        for p in held:
            self.add_to_bucket(p)
        self.reduce_bucket()

    def norm_for_update(self, shards: list[torch.Tensor]) -> torch.Tensor:
        return self.global_norm()

    def clip(self, shards: list[torch.Tensor], norm: torch.Tensor) -> None:
        clip_by_reciprocal(shards, norm, self.max_norm)

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
