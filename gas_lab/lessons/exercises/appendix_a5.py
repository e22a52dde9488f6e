"""Appendix A5's exercise (tutorials/A5_memory_and_offload.ipynb): how many ranks a model needs
at each ZeRO stage for one rank's bf16 mixed-precision training state to fit a budget. A checker
says PASS, TODO or NOT YET with the case, what it expected and what it got; the fix comes on a
second wrong try of the same case, or from :func:`hint`."""

from __future__ import annotations

import functools
from collections.abc import Callable

from gas_lab.lessons.exercises.verdict import Miss, Verdict, check_cases
from gas_lab.lessons.exercises.verdict import hint as hint  # appendix_a5.hint()

BF16_BYTES = {"weights": 2, "gradients": 2, "master": 4, "optimizer state": 8}  # per parameter
SHARDED_FROM = {"master": 1, "optimizer state": 1, "gradients": 2, "weights": 3}
TIME_LIMIT_S = 2.0


def bf16_bytes_per_rank(params: int, stage: int, world: int) -> float:
    """bf16 mixed precision, Adam, no padding or counters: bytes one rank holds."""
    return sum(
        n * params / (world if stage >= SHARDED_FROM[k] else 1) for k, n in BF16_BYTES.items()
    )


def ranks_needed(params: int, stage: int, budget: int) -> int | None:
    """The smallest W whose per-rank bytes fit ``budget``, or None (exact, in integers)."""
    whole = sum(n for k, n in BF16_BYTES.items() if stage < SHARDED_FROM[k]) * params
    sharded = 16 * params - whole
    if whole + sharded <= budget:
        return 1
    if budget <= whole:  # the part no number of ranks divides already fills the budget
        return None
    return -(-sharded // (budget - whole))


RANK_CASES = [  # (params, stage, budget in bytes)
    (7 * 10**9, 3, 80 * 10**9),
    (10**9, 0, 24 * 10**9),
    (7 * 10**9, 1, 40 * 10**9),
    (7 * 10**9, 2, 20 * 10**9),
    (7 * 10**9, 0, 80 * 10**9),
    (7 * 10**9, 1, 24 * 10**9),
    (70 * 10**9, 3, 80 * 10**9),
]


def _wrong_models(params: int, stage: int, budget: int) -> dict[str, int | None]:
    """What the typical wrong models of memory answer: everything sharded from stage 1, or
    fp32 sizes (4 + 4 + 4 + 8 bytes)."""

    def smallest(per_rank, limit=4096):
        return next((w for w in range(1, limit) if per_rank(w) <= budget), None)

    return {
        "all sharded": smallest(lambda w: 16 * params / (w if stage >= 1 else 1)),
        "fp32 sizes": smallest(
            lambda w: sum(
                n * params / (w if stage >= SHARDED_FROM[k] else 1)
                for k, n in {
                    "weights": 4,
                    "gradients": 4,
                    "master": 4,
                    "optimizer state": 8,
                }.items()
            )
        ),
    }


def _ranks_judge(case, got) -> Miss | None:
    params, stage, budget = case
    want = ranks_needed(params, stage, budget)
    if got == want:
        return None
    gb = budget / 1e9
    if got == "timeout":
        return Miss(
            f"no answer within {TIME_LIMIT_S:g} s: a search over W that never finds one does "
            "not end.",
            "some stages have a floor no W goes below (what stays whole on every rank): "
            "return None when that floor alone reaches the budget, before searching.",
        )
    if not (got is None or (isinstance(got, int) and got >= 1)):
        return Miss(f"you returned {got!r}; expected a number of ranks (an int >= 1) or None.")
    wrong = _wrong_models(params, stage, budget)
    fix = None
    if got == wrong["all sharded"] and stage in (1, 2):
        fix = (
            f"at stage {stage} only "
            + (
                "the fp32 master and Adam's moments (12 bytes per parameter) are"
                if stage == 1
                else "the master, the moments and the gradients (14 bytes) are"
            )
            + " sharded; the rest stays whole on every rank, whatever W is."
        )
    elif got == wrong["fp32 sizes"]:
        fix = (
            "bf16 mixed precision holds 2 + 2 + 12 bytes per parameter: bf16 weights and "
            "gradients, an fp32 master copy and Adam's two fp32 moments."
        )
    elif got is None:
        fix = "this stage shards enough that some W fits: solve whole + sharded / W <= budget."
    elif want is None and stage == 0:
        fix = "stage 0 shards nothing: more ranks never shrink what a rank holds."
    elif want is None:
        fix = "what stays whole on every rank already exceeds the budget: no W fits."
    if got is None:
        return Miss("you said no number of ranks fits; some W does.", fix)
    held = bf16_bytes_per_rank(params, stage, got) / 1e9
    if held > gb:
        return Miss(f"with W = {got} a rank holds {held:.1f} GB, over the {gb:g} GB budget.", fix)
    return Miss(
        f"W = {got} fits ({held:.1f} GB), but fewer ranks fit too.",
        fix or "return the SMALLEST W that fits.",
    )


def _with_time_limit(fn: Callable, *args):
    """``fn(*args)``, or "timeout" after :data:`TIME_LIMIT_S` (a loop that never ends). Only
    in the main thread (a signal); elsewhere without a limit."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return fn(*args)

    class _Timeout(Exception):
        pass

    def stop(signum, frame):
        raise _Timeout

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, TIME_LIMIT_S)
    try:
        return fn(*args)
    except _Timeout:
        return "timeout"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def check_ranks_needed(fn: Callable) -> Verdict:
    """Appendix A5's exercise: ``fn(params, stage, budget)`` -> the smallest number of ranks
    at which one rank's bf16 mixed-precision training state fits ``budget`` bytes, or None."""

    def case(c):
        params, stage, budget = c
        name = f"{params / 1e9:g}B parameters, stage {stage}, {budget / 1e9:g} GB"
        return (
            name,
            lambda: _with_time_limit(fn, params, stage, budget),
            functools.partial(_ranks_judge, c),
        )

    return check_cases(
        "how many ranks?",
        [case(c) for c in RANK_CASES],
        "per parameter, 2 + 2 + 12 bytes; from stage 1 the 12 are divided by W, from stage 2 "
        "the gradient's 2 too, at stage 3 the weights' 2 as well. Whatever is not divided is a "
        "floor no W goes below.",
        where="*What a rank holds* (the table of bytes per parameter) and *Scaled up*",
    )
