"""Bytes per rank, measured from the tensors a training run really holds.

ZeRO-1's promise is "optimizer state / W per rank". This module checks it by summing the bytes
of the tensors in ``optimizer.state`` (Adam: ``exp_avg``, ``exp_avg_sq``, ``step``; SGD with
momentum: ``momentum_buffer``) on each rank, for a gas_lab engine or a DeepSpeed one::

    mem = measure(engine)          # after at least one step(): optimizers create state lazily
    mem.state_bytes                # e.g. 244 on each of 2 ranks, vs 480 at stage 0

Two kinds of state behave differently: *element-wise* state has one number per weight and is
what sharding divides by W; *per-tensor* state (Adam's ``step`` counter, one 4-byte scalar per
tensor the optimizer sees) does not shrink, but it is a few bytes. :func:`project` extrapolates
the element-wise part to other world sizes from the measured bytes per element.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gas_lab.zero1 import Layout


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def torch_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside (DeepSpeed's ZeRO optimizer wraps one as ``.optimizer``)."""
    while not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


@dataclass
class RankMemory:
    """What one rank holds for training, in bytes (gradients are transient and not counted)."""

    stage: int
    world_size: int
    model_numel: int  # weights in the model (all of them, on every rank)
    weight_bytes: int  # the model's weights
    master_bytes: int  # tensors the optimizer steps on that are not the model's weights
    optimizer_numel: int  # elements the optimizer steps on (a shard, with padding, at stage 1)
    state: dict[str, int] = field(default_factory=dict)  # optimizer.state key -> bytes
    elementwise_bytes: int = 0  # state with one number per element (sharded by ZeRO-1)
    per_tensor_bytes: int = 0  # state with one number per tensor (step counters)

    @property
    def state_bytes(self) -> int:
        return sum(self.state.values())

    @property
    def state_bytes_per_element(self) -> float:
        """Element-wise state per element the optimizer owns (Adam fp32: 8, SGD momentum: 4)."""
        return self.elementwise_bytes / self.optimizer_numel if self.optimizer_numel else 0.0


def measure(engine) -> RankMemory:
    """Measure this rank's memory from ``engine``'s tensors (gas_lab or DeepSpeed engine)."""
    opt = torch_optimizer(engine.optimizer)
    weights = list(engine.module.parameters())
    weight_ptrs = {p.data_ptr() for p in weights}
    stepped = [p for group in opt.param_groups for p in group["params"]]
    mem = RankMemory(
        stage=engine.zero_optimization_stage(),
        world_size=_world_size(engine),
        model_numel=sum(p.numel() for p in weights),
        weight_bytes=sum(tensor_bytes(p) for p in weights),
        # At stage 0 the optimizer steps on the weights themselves; at stage 1 on a copy.
        master_bytes=sum(tensor_bytes(p) for p in stepped if p.data_ptr() not in weight_ptrs),
        optimizer_numel=sum(p.numel() for p in stepped),
    )
    for p in stepped:
        for key, value in opt.state.get(p, {}).items():
            if not torch.is_tensor(value):
                continue
            mem.state[key] = mem.state.get(key, 0) + tensor_bytes(value)
            if value.numel() == p.numel() and value.dim() > 0:
                mem.elementwise_bytes += tensor_bytes(value)
            else:
                mem.per_tensor_bytes += tensor_bytes(value)
    return mem


def project(bytes_per_element: float, numel: int, world_size: int, stage: int) -> float:
    """Element-wise optimizer state per rank (a projection, from measured bytes per element).

    Stage 0: every rank holds state for all ``numel`` weights. Stage 1: for one shard of the
    padded flat vector, laid out as :class:`gas_lab.zero1.Layout` does.
    """
    owned = numel if stage == 0 else Layout.of([numel], world_size).shard_size
    return bytes_per_element * owned


def _world_size(engine) -> int:
    if hasattr(engine, "dp_world_size"):  # a DeepSpeed engine
        return engine.dp_world_size
    return torch.distributed.get_world_size(engine.group) if engine.group is not None else 1


# -- every tensor a rank holds, by what it is for (lesson 09) ------------------------------------
CATEGORIES = ("weights", "master", "gradients", "optimizer state", "bucket", "other")
# Attribute names -> category, first match wins (DeepSpeed 0.19.8's names and gas_lab's).
_NAMES = (
    ("other", ("norm",)),  # DeepSpeed keeps the last gradient norm: a scalar, not a gradient
    ("bucket", ("ipg", "bucket")),
    ("gradients", ("grad", "accumulated")),
    ("master", ("fp32", "master", "single_partition")),
    ("weights", ("bit16", "flat", "ds_tensor", "partitioned_param")),
)


def census(engine, depth: int = 4, paths: dict | None = None) -> dict[str, int]:
    """Bytes this rank holds for training, by category (:data:`CATEGORIES`), each storage
    counted once however many views point into it (the model's weights are views of a flat
    buffer at ZeRO-1/2). Works on a gas_lab or a DeepSpeed engine, at any ZeRO stage.

    Walks the module's parameters (their data, ZeRO-3's ``ds_tensor`` partition, ``.grad``),
    the torch optimizer (its state; the tensors it steps when they are not the weights:
    "master"), then the attributes of the strategy or ZeRO optimizer object (``depth`` levels),
    classified by attribute name. "bucket" is the reduction bucket: DeepSpeed allocates
    ``reduce_bucket_size`` elements for it (on a CPU, pages never written cost no RAM).
    ``paths``, if a dict, receives where each storage was found first (``"module.0.weight"``,
    ``"optimizer.state"``, ``".fp32_groups_flat_partition"``, ...) -> (category, bytes).
    """
    seen: set[int] = set()
    out = dict.fromkeys(CATEGORIES, 0)

    def add(category: str, t, path: str) -> None:
        if not torch.is_tensor(t) or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            return
        seen.add(storage.data_ptr())
        out[category] += storage.nbytes()
        if paths is not None:
            held = paths.get(path, (category, 0))[1]
            paths[path] = (category, held + storage.nbytes())

    for name, p in engine.module.named_parameters():
        add("weights", getattr(p, "ds_tensor", None), f"module.{name}")  # ZeRO-3: a partition
        add("weights", p.data, f"module.{name}")
        add("gradients", p.grad, f"module.{name}.grad")
    opt = torch_optimizer(engine.optimizer)
    for state in opt.state.values():
        for value in state.values():
            add("optimizer state", value, "optimizer.state")
    for group in opt.param_groups:
        for p in group["params"]:
            add("master", p, "optimizer.param_groups")
            add("gradients", p.grad, "optimizer.param_groups.grad")

    def walk(name: str, obj, levels: int) -> None:
        if torch.is_tensor(obj):
            add(_category(name), obj, name)
            add("gradients", obj.grad, f"{name}.grad")
        elif levels <= 0 or isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
            return
        elif isinstance(obj, dict):
            for key, value in obj.items():
                walk(f"{name}.{key}", value, levels - 1)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                walk(name, value, levels - 1)
        elif type(obj).__module__.split(".")[0] in ("deepspeed", "gas_lab"):
            for key, value in vars(obj).items():
                walk(f"{name}.{key}", value, levels - 1)

    holder = getattr(engine, "strategy", None) or engine.optimizer  # gas_lab's strategy, or ZeRO
    walk("", holder, depth)
    return out


def _category(path: str) -> str:
    path = path.lower()
    for category, words in _NAMES:
        if any(w in path for w in words):
            return category
    return "other"


PRECISIONS = ("fp32", "bf16")
#: Bytes per weight a rank holds, by category: fp32 training, and bf16 mixed precision (bf16
#: weights and gradients, an fp32 master copy, Adam's two fp32 moments: 2 + 2 + 12).
BYTES_PER_WEIGHT = {
    "fp32": {"weights": 4, "master": 4, "gradients": 4, "optimizer state": 8},
    "bf16": {"weights": 2, "master": 4, "gradients": 2, "optimizer state": 8},
}
#: The first ZeRO stage at which a rank keeps only its shard of each category.
SHARDED_FROM = {"master": 1, "optimizer state": 1, "gradients": 2, "weights": 3}


def project_census(
    numel: int, world_size: int, stage: int, tensors: int = 1, precision: str = "fp32"
) -> dict[str, int]:
    """A projection, Adam: what a rank holds at a ZeRO stage for ``numel`` weights, by
    category, with gas_lab's layout (one padded flat vector cut into ``world_size`` shards).

    Per weight, :data:`BYTES_PER_WEIGHT` of each category, whole or (from
    :data:`SHARDED_FROM`) a shard; ``precision`` ``"fp32"``: 4 + 4 + 8, and no master at
    stage 0, where the optimizer steps on the weights themselves; ``"bf16"``: 2 + 2 + 4 + 8,
    the fp32 master at every stage. Plus a 4-byte ``step`` counter per tensor the optimizer
    steps (``tensors``: the model's tensors at stage 0, one per param group from stage 1).
    fp32, it reproduces gas_lab's measured census exactly at stages 0-2; DeepSpeed holds more
    gradient at stage 2 (whole gradients of the parameters that overlap a shard) and cuts each
    tensor apart at stage 3.
    """
    if precision not in BYTES_PER_WEIGHT:
        raise ValueError(f"precision {precision!r}: one of {', '.join(PRECISIONS)}")
    size = BYTES_PER_WEIGHT[precision]
    shard = Layout.of([numel], world_size).shard_size
    whole = numel if stage == 0 else shard * world_size  # ZeRO pads the flat vector

    def held(category: str, elements: int) -> int:
        return size[category] * (shard if stage >= SHARDED_FROM[category] else elements)

    return {
        "weights": held("weights", whole),
        "master": 0 if stage == 0 and precision == "fp32" else held("master", numel),
        "gradients": held("gradients", numel),
        "optimizer state": held("optimizer state", numel) + 4 * tensors,
    }
