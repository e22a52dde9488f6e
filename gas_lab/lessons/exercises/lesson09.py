"""Checkers for lesson 09's exercises (beyond ZeRO-1).

1. :func:`check_traffic_predictions`: predict the collectives of one steady optimizer step for
   runs the lesson did not measure: a bucket smaller than the gradient, ZeRO-3 with every weight
   partitioned and managed accumulation, no clipping at stage 2, padding. Measured on the ranks.
2. :func:`check_sum_weight`: the loss weight of :func:`gas_lab.lessons.loops.equal_n_train`
   under ``"gradient_allreduce_op": "sum"``; trains gas_lab's ZeRO-2 on the ranks with it.

A first wrong try says what differs and where to look; the fix comes on a second wrong try of
the same case, or from :func:`hint`. (Which stage fits a memory budget: appendix A5's exercise,
:mod:`gas_lab.lessons.exercises.appendix_a5`.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from gas_lab.lessons.exercises import traffic
from gas_lab.lessons.exercises.on_ranks import run_on_ranks
from gas_lab.lessons.exercises.traffic import Traffic
from gas_lab.lessons.exercises.verdict import Miss, Verdict, check_cases
from gas_lab.lessons.exercises.verdict import hint as hint  # lessonNN.hint()
from gas_lab.toys import tiny_model
from gas_lab.zero1 import Layout

# ---------------------------------------------------------------- exercise 1: predict the traffic
TRAFFIC = {
    "A": Traffic("gas_lab", 2, False, 3, zero=(("reduce_bucket_size", 40),)),
    "B": Traffic("deepspeed", 3, True, 2, zero=(("stage3_param_persistence_threshold", 0),)),
    "C": Traffic("deepspeed", 2, False, 2, clipping=0.0, hidden=5),
    "D": Traffic("deepspeed", 3, False, 3),
}


def _config(t: Traffic) -> dict:
    from gas_lab.measure.stages import config

    return config(
        t.stage,
        t.managed,
        gas=t.micro_batches,
        zero_optimization=dict(t.zero),
        gradient_clipping=t.clipping,
    )


def _measure_traffic(t: Traffic) -> dict[str, tuple[int, int]]:
    """On a rank: {kind: (calls, bytes)} of the first step after the warm-up."""
    from gas_lab.measure.stages import WARMUP, traffic

    model_fn = functools.partial(tiny_model, hidden=t.hidden)
    ns = None if t.managed else [t.micro_batches]
    phases = traffic(t.library, _config(t), ns, model_fn=model_fn)["phases"]
    out: dict[str, tuple[int, int]] = {}
    for call in (c for p in phases if p.step == WARMUP for c in p.calls):
        calls, nbytes = out.get(call.kind, (0, 0))
        out[call.kind] = (calls + 1, nbytes + call.bytes)
    return out


def measured_traffic(letter: str, cluster) -> dict[str, tuple[int, int]]:
    """Run ``letter``'s collectives, measured on the ranks (once per session)."""
    return traffic.measured_traffic("lesson09", TRAFFIC, _measure_traffic, letter, cluster)


def _traffic_fix(t: Traffic, world: int, got: dict, want: dict) -> str | None:
    """The fix for the mistake this answer makes, when it is a known one."""
    grad = 4 * t.numel
    reduce, want_reduce = got.get("all_reduce", (0, 0)), want.get("all_reduce", (0, 0))
    if t.stage == 3 and reduce[1] == want_reduce[1] - 4:
        return "ZeRO-3 all-reduces the gradient norm in float64: 8 bytes, not 4."
    if t.stage == 2 and t.clipping == 0.0 and reduce == (t.micro_batches, t.micro_batches * grad):
        return "stage 2 all-reduces the 4-byte norm even with gradient_clipping 0."
    if "reduce_bucket_size" in dict(t.zero) and reduce[0] == t.micro_batches + 1:
        return (
            f"a bucket of {dict(t.zero)['reduce_bucket_size']} elements holds less than the "
            f"{t.numel}-element gradient; it is reduced whenever the next tensor would overflow "
            "it, so each backward() needs more than one all-reduce (count them tensor by "
            "tensor, in the order autograd finishes them: last layer first)."
        )
    padded = 4 * Layout.of([t.numel], world).padded_numel
    if t.stage < 3 and got.get("all_gather", (0, 0))[1] == grad and padded != grad:
        return f"ZeRO-2 all-gathers the PADDED vector: {padded // 4} elements, a multiple of 2W."
    if t.stage == 3 and dict(t.zero).get("stage3_param_persistence_threshold") == 0:
        if got.get("all_gather", (0, 0))[0] != want.get("all_gather", (0, 0))[0]:
            return "with the threshold at 0 every forward gathers the weights."
    if t.stage == 3 and got.get("all_gather", (0, 0))[0] == 1:
        return "the weights ZeRO-3 keeps whole are all-gathered one tensor at a time."
    return None


def check_traffic_predictions(fn: Callable[[], dict], cluster) -> Verdict:
    """Exercise 1: ``fn()`` -> ``{"A": {"all_reduce": (calls, bytes), ...}, ...}`` for each run
    of :data:`TRAFFIC`: one steady optimizer step, on one rank."""
    return traffic.check_traffic_predictions(
        fn,
        cluster,
        "lesson09",
        TRAFFIC,
        _measure_traffic,
        _traffic_fix,
        "a fixed part per step (the norm, the all-gathers) plus the gradient once per "
        "backward() at stages 2/3; then what each run changes.",
        where="section 7 (*Bytes per optimizer step against N, stages 0 to 3*)",
    )


# ---------------------------------------------------------------- exercise 2: the sum's weight
SUM_CASES = {
    "ranks with 2 and 1, then 1 and 3 micro-batches": lambda step, rank: [(2, 1), (1, 3)][step][
        rank
    ],
    "ranks with 3 and 1, then 2 and 2 micro-batches": lambda step, rank: [(3, 1), (2, 2)][step][
        rank
    ],
}


def _train_with_weight(case: str, weight: Callable) -> tuple:
    """On a rank: gas_lab's ZeRO-2 with the sum reduction and ``weight``; its parameters and
    those of the single-process reference (the mean over every real micro-batch)."""
    from gas_lab.deepspeed_compat.engine import initialize
    from gas_lab.lessons.loops import equal_n_train
    from gas_lab.measure.parity import reference_params
    from gas_lab.measure.stages import config
    from gas_lab.toys import flat_params

    micro_batches = SUM_CASES[case]
    # SGD: Adam would hide a gradient W times too large (its update barely depends on scale)
    sgd = {"type": "SGD", "params": {"lr": 0.1}}
    cfg = config(
        2,
        managed=False,
        gradient_allreduce_op="sum",
        gradient_clipping=0.0,
        optimizer=sgd,
        zero_allow_untested_optimizer=True,
    )
    engine, _ = equal_n_train(initialize, cfg, 2, micro_batches, weight=weight)
    return flat_params(engine.module), reference_params(cfg, 2, micro_batches)


def _sum_judge(fn: Callable, result) -> Miss | None:
    params, reference = result
    err = (params - reference).abs().max().item()
    if err <= 1e-6:
        return None
    said = f"your parameters end {err:.2g} from the reference's"
    world, total, n = 2, 4, 1
    padding, real = fn(False, n, total, world), fn(True, n, total, world)
    if padding != 0:
        return Miss(
            f"{said}; a padding micro-batch weighs {padding:g}, so it adds to the update.",
            "a padding micro-batch repeats a real one's data: weigh it 0 so it adds nothing.",
        )
    if abs(real - world / total) < 1e-12:
        return Miss(
            f"{said}; a real micro-batch weighs W / total, and the update came out W times "
            "the mean.",
            "W / total is the mean's weight: the ranks' average divides by W afterwards. A sum "
            "does not divide by W, so each real micro-batch weighs 1 / total.",
        )
    if abs(real - 1 / n) < 1e-12 or abs(real - 1 / (n * world)) < 1e-12:
        return Miss(
            f"{said}; a real micro-batch's weight depends on its own rank's count n.",
            "every real micro-batch of the step weighs the same, whichever rank ran it: divide "
            "by the step's count over all ranks.",
        )
    return Miss(f"{said}.")


def check_sum_weight(fn: Callable, cluster) -> Verdict:
    """Exercise 2: ``fn(real, n, total, world)`` -> the loss weight under the sum reduction."""

    def case(name):
        def run():
            fn(True, 1, 2, 2)  # an untouched TODO says so before the ranks are used
            per_rank = run_on_ranks(cluster, _on_rank_sum, fn, name, timeout=120)
            return per_rank[0]

        return (name, run, functools.partial(_sum_judge, fn))

    return check_cases(
        "the padding loop with a sum",
        [case(name) for name in SUM_CASES],
        "with the sum, the ranks' gradients add up: the step's update is the sum over every "
        "rank's micro-batches of weight x gradient. Make that the mean over all real ones.",
        where="section 8 (*Different N per rank at stage 2*): `loops.mean_weight`",
    )


def _on_rank_sum(fn, name):
    return _train_with_weight(name, fn)
