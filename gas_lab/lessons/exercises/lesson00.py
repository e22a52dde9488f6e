"""Checkers for lesson 00's exercises: two collectives the lesson did not show.

Lesson 00 shows one collective, ``all_reduce`` with its default sum. The exercises need two
more ideas: ``all_gather`` wants tensors of the same size on every rank (so variable-length
data travels padded, after its lengths), and ``all_reduce`` takes other operations than a
sum (so the ranks can agree on a yes/no without anyone summing losses).
Both run the learner's function on every rank, so their checkers take the ``cluster``.
"""

from __future__ import annotations

import math

from gas_lab.lessons.exercises.on_ranks import run_on_ranks
from gas_lab.lessons.exercises.verdict import Miss, Verdict, check_cases
from gas_lab.lessons.exercises.verdict import hint as hint  # lessonNN.hint()
from gas_lab.runtime.rank_errors import RankError, RankStallError


# ---------------------------------------------------------------- exercise 1: ragged all_gather
def _values(rank: int, length: int) -> list[float]:
    return [float(10 * rank + i + 1) for i in range(length)]  # never 0.0, unlike padding


def _gather_case(fn, lengths):
    """Runs on each rank: this rank's 1-D tensor of its own length -> the learner's result."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    out = fn(torch.tensor(_values(rank, lengths[rank]), dtype=torch.float32))
    return None if out is None else [float(v) for v in torch.as_tensor(out).reshape(-1)]


def check_gather_ragged(fn, cluster) -> Verdict:
    """``fn(x)`` on every rank, ``x`` of a different length per rank: expect every rank's values,
    rank 0's first, with no padding left in, on every rank."""
    w = cluster.world_size
    cases = {
        "equal lengths": [3] * w,
        "a different length on every rank": [2 + 3 * r for r in range(w)],
        "one rank with nothing": [0] + [4] * (w - 1),
    }

    def run(lengths):
        def go():
            try:
                return run_on_ranks(cluster, _gather_case, fn, lengths, timeout=20)
            except (RankError, RankStallError) as err:  # gloo refuses unequal all_gather sizes
                return err

        return go

    def judge(lengths):
        want = [v for r in range(w) for v in _values(r, lengths[r])]

        def problem(results) -> Miss | None:
            if isinstance(results, RankError | RankStallError):
                first = str(results).splitlines()[0]
                return Miss(
                    f"the ranks failed ({first}): all_gather moves tensors of the SAME size on "
                    f"every rank, and these have {lengths} elements."
                )
            for rank, got in enumerate(results):
                if got == want:
                    continue
                if got is None:
                    return Miss(
                        f"rank {rank} returned None; expected {want}.",
                        "return the gathered values, as a tensor.",
                    )
                if got == _values(rank, lengths[rank]):
                    return Miss(f"rank {rank} returned only its own values {got}; expected {want}.")
                if [v for v in got if v != 0.0] == want:
                    return Miss(
                        f"rank {rank} returned {got}, expected {want}: zeros no rank holds "
                        f"(lengths {lengths}).",
                        "the padding is still in: keep only lengths[r] values of rank r's piece.",
                    )
                return Miss(f"rank {rank} returned {got}, expected {want} (rank 0's values first).")
            return None

        return problem

    return check_cases(
        "all_gather of variable-length data",
        [(name, run(lengths), judge(lengths)) for name, lengths in cases.items()],
        "first all_gather the lengths (one number per rank), pad your tensor to the longest, "
        "all_gather the padded tensors, then keep lengths[r] values of rank r's piece.",
        where="section 5 (*Hello, all-reduce*): one collective, one tensor from every rank; "
        "here, what must every rank know before the values can travel?",
    )


# ---------------------------------------------------------------- exercise 2: skip together
_HUGE = 3.0e38  # float32's largest is 3.4e38: two of these overflow a float32 sum


def _skip_case(fn, losses):
    """Runs on each rank: this rank's loss -> the learner's verdict (a bool)."""
    import torch.distributed as dist

    out = fn(losses[dist.get_rank()])
    return out if out is None else bool(out)


def check_any_rank_overflowed(fn, cluster) -> Verdict:
    """``fn(loss)`` on every rank: True on EVERY rank if any rank's loss is inf or nan."""
    w = cluster.world_size
    cases = {
        "every loss finite": [0.5 + r for r in range(w)],
        "nan on the last rank only": [0.5] * (w - 1) + [math.nan],
        "inf on rank 0 only": [math.inf] + [0.5] * (w - 1),
        "every loss finite, and huge": [_HUGE] * w,
    }

    def judge(losses):
        want = any(not math.isfinite(v) for v in losses)

        def problem(results) -> Miss | None:
            if any(r is None for r in results):
                return Miss(
                    f"a rank returned None ({results}); expected {want} on every rank.",
                    "return True or False.",
                )
            if len(set(results)) > 1:
                return Miss(
                    f"the ranks disagree: {results} for losses {losses}; expected {want} on every "
                    "rank. One rank would skip the step and another would not.",
                    "each rank looked only at its own loss: combine the ranks' answers with a "
                    "collective (all_reduce a 0/1 flag).",
                )
            if results[0] == want:
                return None
            if not want and all(v == _HUGE for v in losses):
                return Miss(
                    f"every rank said True, but every loss is finite ({_HUGE:g} on each rank).",
                    "summing the losses overflowed float32 to inf. Reduce a 0/1 flag (or use "
                    "op=ReduceOp.MAX on it), not the losses.",
                )
            return Miss(f"every rank said {results[0]} for losses {losses}; expected {want}.")

        return problem

    return check_cases(
        "skip the step together",
        [
            (name, lambda v=v: run_on_ranks(cluster, _skip_case, fn, v), judge(v))
            for name, v in cases.items()
        ],
        "turn your own verdict into a number (1.0 if not math.isfinite(loss) else 0.0), "
        "all_reduce it with op=dist.ReduceOp.MAX (or a SUM, then > 0), and return that on every "
        "rank.",
        where="section 5 (*Hello, all-reduce*): what all_reduce combines, and how (its `op=`)",
    )
