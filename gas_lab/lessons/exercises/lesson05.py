"""Checkers for lesson 05 (ZeRO-1: shards, the global norm, the gradient shard).

Exercise 1 is arithmetic and runs here; exercises 2 and 3 run the learner's function on every
rank, through ``run_on_ranks``, so their checkers take ``cluster``.
Judges recognise the classic mistakes: no padding, unaligned shards, a shard's own norm instead
of the global one, norms added instead of squares, a sum instead of a mean, the wrong shard.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gas_lab.lessons.exercises.on_ranks import run_on_ranks
from gas_lab.lessons.exercises.verdict import Verdict, check_cases
from gas_lab.zero1 import ALIGNMENT, Layout

TOL = 1e-5  # float32 noise on vectors of ~50 numbers is ~1e-7


# ---------------------------------------------------------------- exercise 1: shard ranges
def _ranges_case(fn: Callable, numel: int, world: int) -> Callable[[], dict]:
    def run() -> dict:
        got = [tuple(int(v) for v in fn(numel, world, rank)) for rank in range(world)]
        return {"numel": numel, "world": world, "got": got}

    return run


def _judge_ranges(r: dict) -> str | None:
    numel, world, got = r["numel"], r["world"], r["got"]
    layout = Layout.of([numel], world)
    want = [layout.shard(rank) for rank in range(world)]
    if got == want:
        return None
    sizes = {end - start for start, end in got}
    covered = got[-1][1] if got else 0
    where = f"numel {numel}, world size {world}: expected {want}, got {got}"
    if len(sizes) > 1:
        return f"{where}; shards must all have the same size (all-gather needs equal pieces)."
    if covered < numel:
        return (
            f"{where}; the shards end at element {covered}, so {numel - covered} real "
            "elements belong to no rank: pad the vector up before cutting (round up)."
        )
    (size,) = sizes
    if size % ALIGNMENT:
        return (
            f"{where}; a shard of {size} elements is not a multiple of {ALIGNMENT}: pad to a "
            f"multiple of {ALIGNMENT} x world size, as DeepSpeed does, so every shard starts "
            "aligned."
        )
    return f"{where}; pad to the SMALLEST multiple of {ALIGNMENT} x world size >= numel."


def check_shard_ranges(fn: Callable) -> Verdict:
    """Exercise 1: ``fn(numel, world_size, rank)`` -> (start, end) of rank's shard."""
    cases = [(58, 2), (43, 2), (10, 4), (64, 8), (3, 8)]
    return check_cases(
        "shard ranges",
        [(f"numel {n}, world size {w}", _ranges_case(fn, n, w), _judge_ranges) for n, w in cases],
        f"round numel up to a multiple of {ALIGNMENT} x world_size, divide by world_size: "
        "that is the shard size; rank r owns [r x size, (r + 1) x size).",
    )


# ---------------------------------------------------------------- exercise 2: the global norm
def _gradient(numel: int, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def _my_shard(numel: int, seed: int) -> torch.Tensor:
    import torch.distributed as dist

    layout = Layout.of([numel], dist.get_world_size())
    start, end = layout.shard(dist.get_rank())
    return torch.nn.functional.pad(_gradient(numel, seed), (0, layout.padding))[start:end]


def _norm_case(fn: Callable, numel: int, seed: int) -> dict:
    """On a rank: the learner's global norm, from this rank's shard only."""
    import torch.distributed as dist

    shard = _my_shard(numel, seed)
    got = fn(shard.clone(), dist.group.WORLD)
    return {"got": float(got), "local": shard.norm().item()}


def check_global_norm(fn: Callable, cluster) -> Verdict:
    """Exercise 2: ``fn(shard, group)`` returns the L2 norm of the whole, sharded gradient."""

    def case(numel: int, seed: int):
        return lambda: (numel, seed, run_on_ranks(cluster, _norm_case, fn, numel, seed))

    def judge(result) -> str | None:
        numel, seed, per_rank = result
        want = _gradient(numel, seed).norm().item()
        locals_ = [r["local"] for r in per_rank]
        for rank, r in enumerate(per_rank):
            got = r["got"]
            if abs(got - want) <= TOL * max(1.0, want):
                continue
            if abs(got - r["local"]) <= TOL:
                return (
                    f"rank {rank} returned {got:.4f}, the norm of its OWN shard; the whole "
                    f"gradient's norm is {want:.4f}. Combine the ranks with an all-reduce."
                )
            if abs(got - sum(locals_)) <= TOL:
                return (
                    f"rank {rank} returned {got:.4f}, the SUM of the shards' norms; norms do "
                    f"not add, squares do: expected {want:.4f}."
                )
            if abs(got - want**2) <= TOL * max(1.0, want**2):
                return f"rank {rank} returned {got:.4f}, the squared norm: take the square root."
            return f"rank {rank} returned {got:.4f}; expected {want:.4f}."
        return None

    return check_cases(
        "global gradient norm",
        [
            ("43 elements", case(43, 0), judge),
            ("58 elements", case(58, 1), judge),
            ("1 element (the other shard is padding)", case(1, 2), judge),
        ],
        "square the shard's norm, dist.all_reduce the square (a sum over ranks), then take "
        "the square root; every rank gets the same number.",
    )


# ---------------------------------------------------------------- exercise 3: gradient shard
def _shard_case(fn: Callable, numel: int, seed: int) -> dict:
    """On a rank: this rank's local gradient (different per rank) -> the learner's shard."""
    import torch.distributed as dist

    rank = dist.get_rank()
    layout = Layout.of([numel], dist.get_world_size())
    flat = torch.nn.functional.pad(_gradient(numel, seed + 100 * rank), (0, layout.padding))
    got = fn(flat.clone(), dist.group.WORLD)
    return {"got": got.detach().clone() if torch.is_tensor(got) else got, "rank": rank}


def check_gradient_shard(fn: Callable, cluster) -> Verdict:
    """Exercise 3: ``fn(flat_grad, group)`` returns this rank's shard of the rank-averaged
    gradient (``flat_grad`` is already padded to a multiple of the world size)."""
    world = cluster.world_size

    def case(numel: int, seed: int):
        return lambda: (numel, seed, run_on_ranks(cluster, _shard_case, fn, numel, seed))

    def judge(result) -> str | None:
        numel, seed, per_rank = result
        layout = Layout.of([numel], world)
        grads = [_gradient(numel, seed + 100 * r) for r in range(world)]
        mean = torch.nn.functional.pad(torch.stack(grads).mean(0), (0, layout.padding))
        for r in per_rank:
            rank, got = r["rank"], r["got"]
            start, end = layout.shard(rank)
            if not torch.is_tensor(got) or got.numel() != layout.shard_size:
                size = got.numel() if torch.is_tensor(got) else type(got).__name__
                return (
                    f"rank {rank} returned {size} elements; its shard has {layout.shard_size} "
                    f"(the padded {layout.padded_numel} / {world} ranks)."
                )
            got = got.reshape(-1)
            if (got - mean[start:end]).abs().max().item() <= TOL:
                continue
            if (got - world * mean[start:end]).abs().max().item() <= TOL:
                return f"rank {rank}'s shard is {world}x the mean: that is the sum; divide by W."
            for other in range(world):
                lo, hi = layout.shard(other)
                if other != rank and (got - mean[lo:hi]).abs().max().item() <= TOL:
                    return f"rank {rank} returned rank {other}'s shard: rank r owns shard r."
            local = torch.nn.functional.pad(grads[rank], (0, layout.padding))[start:end]
            if (got - local).abs().max().item() <= TOL:
                return f"rank {rank} returned its own, unreduced gradient: reduce over ranks."
            return f"rank {rank}'s shard is off by {(got - mean[start:end]).abs().max():.3g}."
        return None

    return check_cases(
        "gradient shard",
        [("58 elements", case(58, 0), judge), ("43 elements", case(43, 1), judge)],
        "dist.reduce_scatter_tensor(out, flat_grad) into a tensor of numel / W, then divide "
        "by W; or all_reduce the whole vector, divide, and slice [rank x size, (rank+1) x size).",
    )
