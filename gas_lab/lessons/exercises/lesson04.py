"""Checkers for lesson 04 (unmanaged accumulation: every step() is the boundary).

Exercise 1 runs on a one-process gas_lab engine (like lesson 03's checkers); exercise 2 runs on
every rank, with a different number of micro-batches per rank, so its checker takes the
notebook's ``cluster``.
"""

from __future__ import annotations

from collections.abc import Callable

from gas_lab.lessons.exercises.lesson03 import MICRO, run_windows, sgd_config
from gas_lab.lessons.exercises.on_ranks import run_on_ranks
from gas_lab.lessons.exercises.verdict import Verdict, check_cases
from gas_lab.measure.parity import reference_params

TOL = 1e-6
GAS = 4  # in the config; the loops below run other numbers of micro-batches on purpose


def _max_diff(a, b) -> float:
    return (a - b).abs().max().item()


# ---------------------------------------------------------------- exercise 1: one RPC step
def _default_scale(engine, micro_batches, loss_fn):
    for x, y in micro_batches:  # the mistake: the engine divides by GAS, not by N
        engine.backward(loss_fn(engine(x), y))
    engine.step()


def check_rpc_step(fn: Callable) -> Verdict:
    """Exercise 1: ``fn(engine, micro_batches, loss_fn)``: one optimizer step over however many
    micro-batches arrive, on an unmanaged engine, every micro-batch weighing the same."""
    config = sgd_config(GAS, managed=False)

    def case(ns: list[int]):
        def run():
            return ns, run_windows(fn, config, ns)

        return run

    def judge(result) -> str | None:
        ns, got = result
        n_steps, samples, _ = got["counters"]
        if n_steps != len(ns):
            return (
                f"{n_steps} optimizer updates for {len(ns)} steps of {ns} micro-batches: "
                "unmanaged, EVERY step() updates; call it once, after the last backward()."
            )
        ref = reference_params(config, len(ns), ns, world_size=1)
        if _max_diff(got["params"], ref) > TOL:
            if _max_diff(got["params"], run_windows(_default_scale, config, ns)["params"]) <= TOL:
                return (
                    f"each loss was divided by GAS = {GAS} (the default scale_wrt_gas=True), not "
                    f"by the step's N, so a step of N micro-batches moved N/{GAS} as far as it "
                    "should: pass scale_wrt_gas=False and divide by N."
                )
            return f"parameters are {_max_diff(got['params'], ref):.2g} from the reference."
        if samples != sum(ns) * MICRO:
            return (
                f"right parameters, but global_samples is {samples} instead of "
                f"{sum(ns) * MICRO}: the engine counts micro-batches in engine.backward(); "
                "a direct loss.backward() is invisible to it."
            )
        return None

    return check_cases(
        "one step of a variable number of micro-batches",
        [(f"steps of {ns} micro-batches (GAS {GAS})", case(ns), judge) for ns in ([4], [3, 5, 2])],
        "N = len(micro_batches); for each: engine.backward(loss_fn(engine(x), y) / N, "
        "scale_wrt_gas=False); then one engine.step().",
    )


# ---------------------------------------------------------------- exercise 2: the divisor
def _per_rank_runs(fn: Callable, table: list[list[int]]) -> dict:
    """On a rank: train with the learner's divisor, and with the two classic wrong ones."""
    import torch.distributed as dist

    from gas_lab.dp import global_count
    from gas_lab.engine import initialize
    from gas_lab.lessons.toys import flat_params
    from gas_lab.measure.parity import train

    world = dist.get_world_size()
    divisors = {
        "learner": fn,
        "own count": lambda n: n,
        "global count": lambda n: global_count(n),
    }
    out = {}
    for name, divisor in divisors.items():
        engine = train(
            initialize,
            sgd_config(GAS, managed=False),
            len(table),
            micro_batches=lambda step, rank: table[step][rank],
            scale_wrt_gas=False,
            loss_divisor=lambda n, divisor=divisor: float(divisor(n)),
        )[0]
        out[name] = flat_params(engine.module)
    out["world"] = world
    return out


def check_loss_divisor(fn: Callable, cluster) -> Verdict:
    """Exercise 2: ``fn(n)`` runs on every rank with this rank's micro-batch count ``n`` for the
    step (before any backward) and returns what each micro-batch loss is divided by."""

    def case(table: list[list[int]]):
        def run():
            return table, run_on_ranks(cluster, _per_rank_runs, fn, table)

        return run

    def judge(result) -> str | None:
        table, per_rank = result
        ref = reference_params(
            sgd_config(GAS, managed=False), len(table), lambda s, r: table[s][r], len(table[0])
        )
        err = max(_max_diff(r["learner"], ref) for r in per_rank)
        if err <= TOL:
            return None
        world = per_rank[0]["world"]
        first = ", ".join(f"rank {r}: {n}" for r, n in enumerate(table[0]))
        if all(_max_diff(r["learner"], r["own count"]) <= TOL for r in per_rank):
            return (
                f"each rank divided by its own count ({first} in step 0), then the engine "
                "averaged the ranks: every RANK weighs the same, not every micro-batch; the "
                f"parameters are off by {err:.2g}."
            )
        if all(_max_diff(r["learner"], r["global count"]) <= TOL for r in per_rank):
            return (
                f"dividing by the global count makes the gradient {world}x too small: the "
                f"engine's all-reduce already divides by the world size ({world}); divide by "
                "global count / world size."
            )
        return f"parameters are {err:.2g} from the per-micro-batch reference."

    tables = {
        "same N on every rank": [[3, 3], [2, 2]],
        "N differs between ranks": [[3, 1], [1, 4], [2, 2]],
        "a rank with no micro-batches": [[2, 0], [0, 3]],
    }
    return check_cases(
        "one divisor for ranks with different N",
        [(name, case(table), judge) for name, table in tables.items()],
        "all-reduce the count first (every rank, even one with n = 0): total = sum of n over "
        "ranks; return total / world_size, the divisor that weighs every micro-batch the same "
        "after the engine averages over ranks.",
    )
