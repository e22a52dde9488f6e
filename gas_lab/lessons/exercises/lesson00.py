"""Checker for lesson 00's exercise: a mean across ranks with ``torch.distributed``."""

from __future__ import annotations

from gas_lab.lessons.exercises.on_ranks import run_on_ranks
from gas_lab.lessons.exercises.verdict import Verdict, check_cases


def _mean_case(fn, values):
    """Runs on each rank: give the learner's function this rank's tensor."""
    import torch
    import torch.distributed as dist

    x = torch.tensor(values[dist.get_rank()], dtype=torch.float32)
    out = fn(x.clone())
    return None if out is None else torch.as_tensor(out).tolist()


def check_mean_across_ranks(fn, cluster) -> Verdict:
    """Run ``fn`` on every rank with a different tensor per rank; expect the mean on all."""
    w = cluster.world_size
    cases = {
        "one number per rank": [[float(r + 1)] for r in range(w)],
        "a vector per rank": [[float(r), 10.0 * r, -1.0] for r in range(w)],
    }

    def run(values):
        return lambda: run_on_ranks(cluster, _mean_case, fn, values)

    def judge(values):
        expected = [sum(col) / w for col in zip(*values, strict=True)]

        def problem(results):
            for rank, got in enumerate(results):
                if got is None:
                    return f"rank {rank} returned None; return the averaged tensor."
                if any(abs(a - b) > 1e-6 for a, b in zip(got, expected, strict=True)):
                    total = [sum(col) for col in zip(*values, strict=True)]
                    why = " (that is the sum: divide by the world size)" if got == total else ""
                    return f"rank {rank} returned {got}, expected {expected}{why}."
            return None

        return problem

    return check_cases(
        "mean across ranks",
        [(name, run(v), judge(v)) for name, v in cases.items()],
        hint="all_reduce sums into the tensor in place on every rank; the mean divides that "
        "sum by dist.get_world_size().",
    )


def _gather_case(fn, losses):
    """Runs on each rank: hand the learner's function this rank's loss (a float)."""
    import torch.distributed as dist

    out = fn(losses[dist.get_rank()])
    return None if out is None else [float(v) for v in out]


def check_losses_from_all_ranks(fn, cluster) -> Verdict:
    """Run ``fn(loss)`` on every rank with a different loss each; expect every rank's list."""
    w = cluster.world_size
    cases = {
        "losses 0.5, 1.5, ...": [0.5 + r for r in range(w)],
        "equal losses": [2.0] * w,
    }

    def judge(losses):
        def problem(results):
            for rank, got in enumerate(results):
                if got is None:
                    return f"rank {rank} returned None; return the list of all ranks' losses."
                if got == [losses[rank]]:
                    return f"rank {rank} returned only its own loss {got}; expected {losses}."
                if len(got) != w or any(
                    abs(a - b) > 1e-6 for a, b in zip(got, losses, strict=True)
                ):
                    return f"rank {rank} returned {got}, expected {losses} (rank 0 first)."
            return None

        return problem

    return check_cases(
        "losses from all ranks",
        [
            (name, lambda v=v: run_on_ranks(cluster, _gather_case, fn, v), judge(v))
            for name, v in cases.items()
        ],
        hint="all_gather fills a list of world-size tensors, one per rank in rank order, on every "
        "rank; allocate that list first, then convert each tensor with .item().",
    )
