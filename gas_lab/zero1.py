"""ZeRO stage 1 from scratch: each rank keeps the optimizer state of one shard of the weights.

At stage 0 every rank holds the whole optimizer state (Adam: two numbers per weight) and runs
the same update on the same averaged gradient: W identical copies of one computation. ZeRO-1
lays all the weights end to end in one flat vector, pads it, and cuts it into W equal shards.
Rank r keeps the optimizer state of shard r only and updates shard r only; then the ranks
all-gather the updated shards, so every rank again holds the whole model for the next forward.

At the accumulation boundary (``gas_lab.engine`` decides when; this module decides how):

1. **reduce** the gradients; rank r needs the averaged gradient of shard r. Two ways
   (``reduce=``): ``"all_reduce"`` the whole gradient, once, and keep shard r (what DeepSpeed
   0.19.8 does by default), or ``"reduce_scatter"``, which delivers each rank only its shard.
   On a ring, an all-reduce moves 2(W-1)/W of the gradient bytes per rank, a reduce-scatter
   half of that; with the all-gather below, reduce-scatter makes ZeRO-1 cost what DDP costs.
2. **clip** by the global norm. A rank holds one shard, so the norm is the square root of the
   *sum over ranks* of each shard's squared norm: one 4-byte all-reduce, at every update
   (only when clipping; DeepSpeed computes it at every update, and reports it).
3. **step** the wrapped optimizer (SGD, Adam, AdamW: any element-wise one) on the shard.
4. **all-gather** the shards into the flat buffer. The model's parameters are views into that
   buffer, so the all-gather writes the new weights straight into the model.

Between the boundary's reduction and the update a parameter's gradient exists only as shards
(``param.grad`` is None).

Taught in lesson 05 (``tutorials/05_zero1.ipynb``). DeepSpeed's buckets, dtypes and
bookkeeping are added on top, in :mod:`gas_lab.deepspeed_compat.zero`.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist

from gas_lab.dp import all_reduce_mean, clip_by_norm, global_norm

# Shard sizes are a multiple of this many elements, as in DeepSpeed (4 bytes of fp16), so
# every shard starts aligned; the flat vector is padded with zeros up to W x that multiple.
ALIGNMENT = 2
REDUCE_MODES = ("all_reduce", "reduce_scatter")


@contextlib.contextmanager
def renamed_collective():
    """Around ``reduce_scatter_tensor`` and ``all_gather_into_tensor``: torch 2.13 renamed both
    (``*_single``) and warns at each call; the old names work on every torch from 2.4 on."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


class Layout:
    """Where each parameter sits in a flat, zero-padded vector cut into ``world_size`` shards.

    ``Layout.of([5, 3], world_size=2)``: 8 elements, padded to 8, shards [0, 4) and [4, 8);
    parameter 0 is split between the two shards. ``Layout.of([5], 2)``: padded to 8, rank 1
    owns elements 4..7, of which only element 4 is real.
    """

    def __init__(self, numels: tuple[int, ...], world_size: int):
        self.numels, self.world_size = numels, world_size
        self.offsets = tuple(sum(numels[:i]) for i in range(len(numels)))
        self.numel = sum(numels)  # real elements, without padding
        unit = ALIGNMENT * world_size
        self.shard_size = -(-self.numel // unit) * unit // world_size  # round up, then cut

    @classmethod
    def of(cls, numels, world_size: int) -> Layout:
        return cls(tuple(int(n) for n in numels), int(world_size))

    def __repr__(self) -> str:
        return (
            f"Layout({self.numel} elements in {len(self.numels)} tensors, {self.world_size} "
            f"shards of {self.shard_size}, padding {self.padding})"
        )

    @property
    def padded_numel(self) -> int:
        return self.shard_size * self.world_size

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def shard(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank's shard in the flat vector."""
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """The parameters that overlap rank's shard: (parameter index, start, end) in the
        parameter's own flat numbering. A parameter may be split across two shards."""
        lo, hi = self.shard(rank)
        out = []
        for i, (offset, n) in enumerate(zip(self.offsets, self.numels, strict=True)):
            start, end = max(lo, offset), min(hi, offset + n)
            if start < end:
                out.append((i, start - offset, end - offset))
        return out


class _FlatGroup:
    """One optimizer param group, flattened: the model's weights become views into ``flat``;
    ``master`` is this rank's shard, the only tensor the optimizer sees."""

    def __init__(self, params: list[torch.nn.Parameter], world_size: int, rank: int):
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise TypeError(f"one param group, one dtype; got {sorted(map(str, dtypes))}")
        self.params = params
        self.layout = Layout.of([p.numel() for p in params], world_size)
        self.start, self.end = self.layout.shard(rank)
        self.flat = torch.zeros(
            self.layout.padded_numel, dtype=params[0].dtype, device=params[0].device
        )
        for p, offset in zip(self.params, self.layout.offsets, strict=True):
            view = self.flat[offset : offset + p.numel()]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view_as(p)  # the weights now live inside flat: no copy after gather
        # A separate fp32 tensor, not a view of flat (ZeRO's "fp32 partition"): the all-gather
        # reads it without aliasing; with half-precision weights it is the master copy.
        self.master = self.flat[self.start : self.end].clone().to(torch.float32)
        self.grad_shard: torch.Tensor | None = None  # set by reduce, consumed by update

    def local_gradient(self, grads=None) -> torch.Tensor:
        """This rank's gradients (``grads``, one per parameter, default their ``.grad``), flat
        and padded, in the gradients' dtype (an unused parameter counts as zeros)."""
        grads = [p.grad for p in self.params] if grads is None else grads
        dtype = next((g.dtype for g in grads if g is not None), self.flat.dtype)
        flat = torch.zeros_like(self.flat, dtype=dtype)
        for g, offset in zip(grads, self.layout.offsets, strict=True):
            if g is not None:
                flat[offset : offset + g.numel()].copy_(g.reshape(-1))
        return flat

    def clear_grads(self) -> None:
        for p in self.params:
            p.grad = None  # the full gradient is not needed once the shard is kept


class ShardedUpdate:
    """ZeRO-1 as the engine's strategy (:class:`gas_lab.engine.Engine`): ``reduce_gradients()``
    at the boundary, then ``update()`` (clip, step the shard, all-gather).

    ``optimizer`` is a fresh torch optimizer over the model's parameters; its param groups are
    re-pointed at this rank's shards (DeepSpeed does the same), so ``optimizer.state`` holds
    only this rank's share. ``reduce``: ``"all_reduce"`` or ``"reduce_scatter"`` (lesson 05).
    Frozen and empty parameters are left out, as in DeepSpeed. A parameter without a gradient
    on this rank is reduced as zeros.
    """

    def __init__(
        self, params, optimizer, group=None, max_norm: float = 0.0, reduce: str = "all_reduce"
    ):
        if reduce not in REDUCE_MODES:
            raise ValueError(f"reduce must be one of {REDUCE_MODES}, got {reduce!r}")
        self.group, self.reduce, self.max_norm = group, reduce, max_norm
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.groups = flat_groups(params, optimizer, self.world_size, self.rank)
        self.optimizer = optimizer

    def after_backward(self) -> None:
        """Nothing: ZeRO-1 reduces at the boundary only."""

    @property
    def master_shards(self) -> list[torch.Tensor]:
        return [g.master for g in self.groups]

    def local_gradient(self, g: _FlatGroup) -> torch.Tensor:
        """This rank's gradient of group ``g``, flat and padded."""
        return g.local_gradient()

    def reduce_gradients(self) -> None:
        """Leave in each group's ``grad_shard`` the rank-averaged gradient of this rank's shard."""
        for g in self.groups:
            self.keep(g, self.reduce_shard(g, self.local_gradient(g)))

    def reduce_shard(self, g: _FlatGroup, local: torch.Tensor) -> torch.Tensor:
        """The rank-averaged gradient of this rank's shard of ``g``."""
        if self.reduce == "all_reduce":
            # Send only the real elements; pad afterwards to cut shards.
            real = local[: g.layout.numel].clone()
            all_reduce_mean([real], self.group)
            return torch.nn.functional.pad(real, (0, g.layout.padding))[g.start : g.end]
        if self.group is None:
            return local[g.start : g.end]
        shard = torch.empty(g.layout.shard_size, dtype=local.dtype, device=local.device)
        with renamed_collective():
            dist.reduce_scatter_tensor(shard, local, group=self.group)
        return shard.div_(self.world_size)  # reduce-scatter sums; we step on the mean

    def keep(self, g: _FlatGroup, shard: torch.Tensor) -> None:
        # Reducing twice before an update (two boundaries) adds up, like .grad would.
        g.grad_shard = shard.clone() if g.grad_shard is None else g.grad_shard + shard
        g.clear_grads()

    def update(self) -> bool:
        """Clip by the global norm, step the optimizer on the shard, all-gather the weights."""
        shards = self.gradient_shards()
        if self.max_norm > 0:
            clip_by_norm(shards, global_norm(shards, self.group), self.max_norm)
        self.optimizer.step()
        self.clear()
        gather_weights(self.groups, self.group)
        return True

    def gradient_shards(self) -> list[torch.Tensor]:
        """Each master shard's gradient: the reduced shard (in fp32, the master's dtype)."""
        for g in self.groups:
            if g.grad_shard is None:
                # No reduction since the last update (e.g. every backward() was in no_sync()):
                # as at stage 0, the optimizer steps on the local gradient.
                g.grad_shard = self.local_gradient(g)[g.start : g.end].clone()
            g.master.grad = g.grad_shard.to(torch.float32)
        return [g.master.grad for g in self.groups]

    def clear(self) -> None:
        for g in self.groups:
            g.master.grad = g.grad_shard = None
            g.clear_grads()


def gather_weights(groups: list[_FlatGroup], group=None) -> None:
    """Every rank's updated master shard into every rank's ``flat``: the model's weights."""
    for g in groups:
        shard = g.master.detach().to(g.flat.dtype)  # the weights' dtype
        if group is None:
            g.flat.copy_(shard)
        else:
            with renamed_collective():
                dist.all_gather_into_tensor(g.flat, shard, group=group)


def flat_groups(params, optimizer, world_size: int, rank: int) -> list[_FlatGroup]:
    """One :class:`_FlatGroup` per optimizer param group, whose fp32 master shard replaces the
    group's parameters in the optimizer (so it only ever sees this rank's shard). Frozen and
    empty parameters are left out. Shared by ZeRO-1 and ZeRO-2."""
    trainable = {id(p) for p in params if p.requires_grad and p.numel() > 0}
    groups: list[_FlatGroup] = []
    for param_group in optimizer.param_groups:
        mine = [p for p in param_group["params"] if id(p) in trainable]
        if not mine:
            param_group["params"] = []
            continue
        flat_group = _FlatGroup(mine, world_size, rank)
        param_group["params"] = [flat_group.master]
        groups.append(flat_group)
    return groups
