"""Checkers for lesson 02 (data parallelism: ranks, averaging, ``no_sync``).

Two exercises run the learner's function on every rank (through
:func:`~gas_lab.lessons.exercises.on_ranks.run_on_ranks`), so their checkers take the notebook's
``cluster``; the third is arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gas_lab.config import resolve_batch
from gas_lab.lessons.exercises.on_ranks import run_on_ranks
from gas_lab.lessons.exercises.verdict import Verdict, check_cases
from gas_lab.lessons.toys import micro_batch, tiny_model
from gas_lab.measure.parity import reference_params

TOL = 1e-6  # float32 noise on these tiny models is ~1e-8
LR = 0.1


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ---------------------------------------------------------------- exercise 1: average gradients
def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().flatten() for p in model.parameters()]).clone()


def _gradient_case(fn: Callable, seed: int) -> dict:
    """On a rank: backward on this rank's 4 samples, then the learner averages the gradients."""
    import torch.distributed as dist

    model = tiny_model(0)
    x, y = micro_batch(seed, 0, 0, dist.get_rank(), 4)
    torch.nn.functional.mse_loss(model(x), y).backward()
    local = _grads(model)
    fn(model)
    return {"got": _grads(model), "local": local}


def _full_gradient(seed: int, world: int) -> torch.Tensor:
    """Reference, in this process: one model, every rank's samples in one mean loss."""
    model = tiny_model(0)
    x, y = (
        torch.cat(t)
        for t in zip(*[micro_batch(seed, 0, 0, r, 4) for r in range(world)], strict=True)
    )
    torch.nn.functional.mse_loss(model(x), y).backward()
    return _grads(model)


def check_average_gradients(fn: Callable, cluster) -> Verdict:
    """Exercise 1: ``fn(model)`` leaves in every ``.grad`` the average over ranks."""
    world = cluster.world_size

    def case(seed: int):
        def run():
            return seed, run_on_ranks(cluster, _gradient_case, fn, seed)

        return run

    def judge(result) -> str | None:
        seed, per_rank = result
        ref = _full_gradient(seed, world)
        for rank, r in enumerate(per_rank):
            err = _max_diff(r["got"], ref)
            if err <= TOL:
                continue
            if _max_diff(r["got"], world * ref) <= TOL:
                return (
                    f"rank {rank} holds {world}x the full-batch gradient: that is the SUM over "
                    "ranks; divide by the world size."
                )
            if _max_diff(r["got"], r["local"]) <= TOL:
                return (
                    f"rank {rank} still holds its own gradient (no all-reduce happened); it is "
                    f"{err:.2g} away from the full-batch one."
                )
            return f"rank {rank}'s gradient is {err:.2g} away from the full-batch gradient."
        return None

    return check_cases(
        "average gradients over ranks",
        [(f"batch seed {s}", case(s), judge) for s in (0, 1)],
        "for every parameter: dist.all_reduce(p.grad) (a sum, in place), then "
        "p.grad /= dist.get_world_size().",
    )


# ---------------------------------------------------------------- exercise 2: DDP + no_sync
def _ddp_case(fn: Callable, n: int, steps: int) -> dict:
    """On a rank: the learner's accumulation step on a real DDP model, collectives counted."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gas_lab.lessons.toys import flat_params
    from gas_lab.measure.comm import count_collectives

    rank = dist.get_rank()
    model = tiny_model(0)
    ddp = DDP(model)
    ddp.register_comm_hook(None, allreduce_hook)  # routes DDP's all-reduce where we can count it
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
    with count_collectives() as log:
        for step in range(steps):
            batches = [micro_batch(0, step, m, rank, 2) for m in range(n)]
            fn(ddp, optimizer, batches, torch.nn.functional.mse_loss)
    return {"params": flat_params(model), "calls": log.count("all_reduce")}


def _sgd_config(n: int, lr: float = LR) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": n,
        "optimizer": {"type": "SGD", "params": {"lr": lr}},
    }


def check_ddp_accumulation_step(fn: Callable, cluster) -> Verdict:
    """Exercise 2: ``fn(ddp_model, optimizer, micro_batches, loss_fn)``: one optimizer step over
    the micro-batches with torch's DDP, and exactly one all-reduce."""
    steps, world = 2, cluster.world_size

    def case(n: int):
        def run():
            return n, run_on_ranks(cluster, _ddp_case, fn, n, steps)

        return run

    def judge(result) -> str | None:
        n, per_rank = result
        ref = reference_params(_sgd_config(n), steps, world_size=world)
        calls = per_rank[0]["calls"]
        err = max(_max_diff(r["params"], ref) for r in per_rank)
        drift = _max_diff(per_rank[0]["params"], per_rank[1]["params"])
        if err > TOL:
            if drift > TOL:
                return (
                    f"the ranks' parameters drifted apart by {drift:.2g} ({calls / steps:g} "
                    "all-reduces per step): the last micro-batch's forward and backward must "
                    "run outside no_sync()."
                )
            too_big = reference_params(_sgd_config(n, LR * n), steps, world_size=world)
            if n > 1 and all(_max_diff(r["params"], too_big) <= TOL for r in per_rank):
                return f"the update is {n}x too large: divide each micro-batch loss by N = {n}."
            return f"parameters are {err:.2g} away from the full-batch reference."
        if calls != steps:
            trap = (
                " DDP decides in forward() whether the next backward() reduces, so no_sync() "
                "must wrap the forward as well as the backward."
                if calls == n * steps
                else ""
            )
            return (
                f"right parameters, but {calls / steps:g} all-reduces per optimizer step "
                f"instead of 1.{trap}"
            )
        return None

    return check_cases(
        "DDP accumulation with one all-reduce",
        [(f"N = {n} micro-batches", case(n), judge) for n in (1, 3)],
        "for all but the last micro-batch: `with model.no_sync():` around BOTH the forward "
        "and loss.backward(); the last one outside it; each loss / N; then one optimizer step "
        "and zero_grad().",
    )


# ---------------------------------------------------------------- exercise 3: batch invariant
def check_gas_for(fn: Callable) -> Verdict:
    """Exercise 3: ``fn(global_batch, micro, world_size)`` returns GAS, or raises ValueError."""

    def case(batch: int, micro: int, world: int):
        def run():
            try:
                return batch, micro, world, fn(batch, micro, world)
            except ValueError as err:
                return batch, micro, world, err

        return run

    def judge(result) -> str | None:
        batch, micro, world, got = result
        try:
            _, _, want = resolve_batch(batch, micro, None, world)
        except ValueError:
            want = None
        if want is None:
            if isinstance(got, ValueError):
                return None
            return (
                f"returned {got!r}, but {batch} samples do not split into micro-batches of "
                f"{micro} on {world} ranks: {batch} / ({micro} x {world}) = "
                f"{batch / (micro * world):g} is not a whole number >= 1; raise ValueError."
            )
        if isinstance(got, ValueError):
            return f"raised ValueError({got}), but GAS = {want} works: {micro} x {want} x {world}."
        if got == batch // micro and world > 1:
            return f"got {got}, expected {want}: the world size is missing (micro x GAS x world)."
        if got != want:
            return f"got {got!r}, expected {want}: {micro} x {want} x {world} = {batch}."
        return None

    cases = [(16, 2, 2), (32, 4, 8), (12, 2, 4), (8, 2, 8)]
    return check_cases(
        "gradient accumulation steps from the batch invariant",
        [(f"global {b}, micro {m}, world {w}", case(b, m, w), judge) for b, m, w in cases],
        "global batch = micro x GAS x world size, so GAS = global / (micro x world), and it "
        "must come out a whole number >= 1.",
    )
