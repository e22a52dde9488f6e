"""Checkers for lesson 02's exercises (data parallelism: averaging, counting, replicas).

1. :func:`check_bucketed_average`: average gradients over ranks in *buckets*, one all-reduce
   per bucket: the middle ground between one call per tensor and the lesson's one flat
   buffer. The checker counts the calls and their bytes with ``count_collectives``.
2. :func:`check_replicas`: a bug hunt. :func:`drifting_replicas` reduces once per step, as the
   lesson taught, and its ranks still never agree; the checker measures how far apart the
   ranks end and how far from the one-process reference.

Both run the learner's function on every rank, so their checkers take the ``cluster``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from gas_lab.dp import all_reduce_mean
from gas_lab.lessons.exercises.on_ranks import run_on_ranks
from gas_lab.lessons.exercises.verdict import Miss, Verdict, check_cases
from gas_lab.lessons.exercises.verdict import hint as hint  # lessonNN.hint()
from gas_lab.measure.parity import reference_params
from gas_lab.toys import flat_params, micro_batch, tiny_model

TOL = 1e-6  # float32 noise on these tiny models is ~1e-8


# ---------------------------------------------------------------- exercise 1: buckets
def buckets(sizes: list[int], bucket_bytes: int, exact_fit: bool = True) -> list[int]:
    """Bytes of each bucket by the exercise's rule: walk the tensors in order and start a new
    bucket when the next one would overflow this one (a tensor bigger than the cap goes alone).
    ``exact_fit=False`` is the common slip: a tensor that fills the bucket exactly opens a new
    one (``<`` for ``<=``)."""
    out: list[int] = []
    for size in sizes:
        total = out[-1] + size if out else None
        if total is not None and (total <= bucket_bytes if exact_fit else total < bucket_bytes):
            out[-1] += size
        else:
            out.append(size)
    return out


def _local_grads(shapes: list[tuple[int, ...]], rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(shape, generator=g) for shape in shapes]


def _bucket_case(fn: Callable, shapes, bucket_bytes: int) -> dict:
    """On a rank: this rank's gradients, averaged in place by the learner, collectives counted."""
    from gas_lab.measure.comm import count_collectives

    grads = _local_grads(shapes, dist.get_rank())
    with count_collectives() as log:
        fn(grads, bucket_bytes)
    return {"grads": grads, "calls": [(c.kind, c.bytes) for c in log.calls]}


def check_bucketed_average(fn: Callable, cluster) -> Verdict:
    """Exercise 1: ``fn(grads, bucket_bytes)`` replaces every tensor of ``grads`` by its average
    over ranks, with one all-reduce per bucket of at most ``bucket_bytes`` bytes."""
    world = cluster.world_size
    shapes = [tuple(p.shape) for p in tiny_model(0).parameters()]  # the lesson's 58 floats
    sizes = [4 * torch.Size(s).numel() for s in shapes]

    def case(bucket_bytes: int):
        return lambda: run_on_ranks(cluster, _bucket_case, fn, shapes, bucket_bytes)

    def judge(bucket_bytes: int):
        want_calls = buckets(sizes, bucket_bytes)
        local = [_local_grads(shapes, r) for r in range(world)]
        mean = [sum(ts) / world for ts in zip(*local, strict=True)]

        def problem(per_rank) -> Miss | None:
            for rank, r in enumerate(per_rank):
                err = max((g - m).abs().max().item() for g, m in zip(r["grads"], mean, strict=True))
                if err <= TOL:
                    continue
                own = max(
                    (g - m).abs().max().item() for g, m in zip(r["grads"], local[rank], strict=True)
                )
                summed = max(
                    (g - world * m).abs().max().item()
                    for g, m in zip(r["grads"], mean, strict=True)
                )
                if own <= TOL:
                    return Miss(
                        f"rank {rank}'s gradients are unchanged: its own, not the average over "
                        "ranks.",
                        "a bucket is a NEW tensor (torch.cat copies): copy the averaged bucket "
                        "back into the gradients.",
                    )
                if summed <= TOL:
                    return Miss(
                        f"rank {rank} holds {world}x the average over ranks.",
                        "divide the sum by the world size.",
                    )
                return Miss(f"rank {rank}'s gradients are {err:.2g} away from the average.")
            calls = per_rank[0]["calls"]
            got = [nbytes for kind, nbytes in calls if kind == "all_reduce"]
            if len(got) != len(calls):
                other = sorted({kind for kind, _ in calls} - {"all_reduce"})
                return Miss(
                    f"right values, but the ranks also called {other}.",
                    "one dist.all_reduce per bucket, no other collective.",
                )
            if got == want_calls:
                return None
            rule = f"tensors of {sizes} bytes, bucket_bytes {bucket_bytes}"
            if got == sizes and len(want_calls) < len(sizes):
                return Miss(
                    f"right values, but one all-reduce per tensor ({len(got)} calls, {rule}); "
                    f"the rule gives {len(want_calls)}: {want_calls} bytes."
                )
            too_big = [b for b in got if b > bucket_bytes and b not in sizes]
            if too_big:
                return Miss(f"a bucket of {too_big[0]} bytes is larger than bucket_bytes ({rule}).")
            differs = f"all-reduces of {got} bytes; the rule gives {want_calls} ({rule})."
            if got == buckets(sizes, bucket_bytes, exact_fit=False):
                return Miss(
                    differs,
                    "a bucket may hold exactly bucket_bytes: open a new one only when the next "
                    "tensor would make it LARGER (size + next <= bucket_bytes still fits).",
                )
            return Miss(differs)

        return problem

    caps = {"one bucket holds everything": 1 << 20, "128-byte buckets": 128}
    caps |= {"160-byte buckets": 160, "100-byte buckets": 100}
    caps |= {"40-byte buckets (smaller than some tensors)": 40}
    return check_cases(
        "bucketed all-reduce",
        [(name, case(cap), judge(cap)) for name, cap in caps.items()],
        "walk the gradients in order, adding each to the current bucket unless that makes it "
        "bigger than bucket_bytes; for each bucket: torch.cat the flattened tensors, one "
        "dist.all_reduce, divide by the world size, copy the pieces back.",
        where="*Averaging gradients, inline* (one flat buffer, one all-reduce, / W), and the "
        "exercise's bucket rule, word by word",
    )


# ---------------------------------------------------------------- exercise 2: find the bug
SEED = 7  # of the data and of the model: rank 0's model is tiny_model(SEED)


def drifting_replicas(steps: int, n: int, lr: float = 0.1) -> torch.Tensor:
    """Data parallelism over ``steps`` optimizer steps of ``n`` micro-batches; one all-reduce per
    step. Returns this rank's parameters. Its ranks never agree."""
    rank = dist.get_rank()
    torch.manual_seed(SEED + rank)  # every rank shuffles its micro-batches differently
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        for m in torch.randperm(n).tolist():
            x, y = micro_batch(SEED, step, m, rank, 2)
            (torch.nn.functional.mse_loss(model(x), y) / n).backward()
        all_reduce_mean([p.grad for p in model.parameters()], dist.group.WORLD)
        optimizer.step()
        optimizer.zero_grad()
    return flat_params(model)


def _replica_case(fn: Callable, steps: int, n: int) -> dict:
    from gas_lab.measure.comm import count_collectives

    with count_collectives() as log:
        params = fn(steps, n)
    return {"params": torch.as_tensor(params).detach().flatten(), "calls": log.by_kind()}


def _sgd_config(n: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": n,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }


def check_replicas(fn: Callable, cluster) -> Verdict:
    """Exercise 2: ``fn(steps, n)``, :func:`drifting_replicas` fixed: every rank ends with the
    parameters of one process that took every rank's micro-batches, starting from rank 0's
    weights (as DDP does), with still one gradient all-reduce per step."""
    world = cluster.world_size

    def case(steps: int, n: int):
        return lambda: run_on_ranks(cluster, _replica_case, fn, steps, n)

    def judge(steps: int, n: int):
        def problem(per_rank) -> Miss | None:
            params = [r["params"] for r in per_rank]
            spread = max((p - params[0]).abs().max().item() for p in params)
            start = max(
                (flat_params(tiny_model(SEED + r)) - flat_params(tiny_model(SEED))).abs().max()
                for r in range(world)
            ).item()
            if spread > TOL:
                if abs(spread - start) < 1e-5:
                    return Miss(
                        f"the ranks end {spread:.4f} apart after {steps} steps, exactly as far as "
                        f"their weights were before the first step ({start:.4f}).",
                        "identical updates applied to different starting weights: averaged "
                        "gradients keep replicas equal only if they START equal. Give every rank "
                        "rank 0's weights after building the model (gas_lab.dp.broadcast_parameters"
                        "), as DDP does.",
                    )
                return Miss(f"the ranks end {spread:.4f} apart after {steps} steps.")
            ref = reference_params(_sgd_config(n), steps, world_size=world, seed=SEED)
            err = (params[0] - ref).abs().max().item()
            if err > TOL:
                return Miss(
                    f"the ranks agree, but are {err:.2g} from the reference, which starts from "
                    "rank 0's initial weights and takes every rank's micro-batches in each step.",
                    "every rank must start from rank 0's weights: broadcast them "
                    "(gas_lab.dp.broadcast_parameters) rather than seeding every rank alike.",
                )
            reduces = per_rank[0]["calls"].get("all_reduce", {}).get("calls", 0)
            if reduces != steps:
                return Miss(
                    f"right parameters, but {reduces} all-reduces in {steps} steps instead of "
                    f"{steps}.",
                    "reduce all the gradients in ONE call per step (all_reduce_mean of the list "
                    "of .grad tensors).",
                )
            return None

        return problem

    return check_cases(
        "replicas that agree",
        [
            (f"{steps} step(s) of {n} micro-batches", case(steps, n), judge(steps, n))
            for steps, n in ((1, 2), (3, 3))
        ],
        "averaged gradients keep replicas equal only if they START equal: compare the ranks' "
        "weights right after the model is built, before the first step; DDP makes every rank "
        "start from rank 0's weights.",
        where="*Accumulation on top: naive vs `no_sync`*: what the wrappers do before the "
        "first step",
    )
