"""Checkers for lesson 05's exercises (ZeRO-1: shards, reductions, what each step sends).

1. :func:`check_shard_accumulation`: reduce every micro-batch's gradient as soon as it exists and
   keep only this rank's shard between micro-batches (the schedule ZeRO-1 does not need, and
   stage 2 will: lesson 09). The checker hands the gradients out one at a time, notes whether
   each was asked for before the previous one was reduced, and checks the shard.
2. :func:`check_traffic_predictions`: predict the collectives (calls and bytes, per kind) of runs
   the lesson did not measure: no clipping, a model whose size needs padding, the reduce-scatter
   variant, DeepSpeed's ``reduce`` to each owner. The checker measures each on the ranks.

Both take the notebook's ``cluster``. A first wrong try says what differs and where to look;
the fix comes on a second wrong try of the same case, or from :func:`hint`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from gas_lab.lessons.exercises import traffic
from gas_lab.lessons.exercises.on_ranks import run_on_ranks
from gas_lab.lessons.exercises.traffic import Traffic
from gas_lab.lessons.exercises.verdict import Miss, Verdict, check_cases
from gas_lab.lessons.exercises.verdict import hint as hint  # lessonNN.hint()
from gas_lab.toys import micro_batch, tiny_model
from gas_lab.zero1 import Layout

TOL = 1e-5  # float32 noise on vectors of ~60 numbers is ~1e-7


# ---------------------------------------------------------------- exercise 1: a shard per micro-batch
def _gradient(numel: int, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def _micro_grads(numel: int, n: int, rank: int, world: int) -> list[torch.Tensor]:
    """This rank's gradient of each micro-batch, flat, zero-padded, already divided by n."""
    pad = Layout.of([numel], world).padding
    return [
        torch.nn.functional.pad(_gradient(numel, 1000 * rank + k), (0, pad)) / n for k in range(n)
    ]


def _shard_case(fn: Callable, numel: int, n: int) -> dict:
    """On a rank: hand ``fn`` the gradients one at a time, noting each one asked for before a
    collective had run since the previous one (two whole gradients held at once)."""
    from gas_lab.measure.comm import count_collectives

    rank, world = dist.get_rank(), dist.get_world_size()
    grads = _micro_grads(numel, n, rank, world)
    early: list[int] = []  # indices of the gradients asked for too early

    with count_collectives() as log:

        def handed_out():
            for k, g in enumerate(grads):
                if len(log) < k:
                    early.append(k)
                yield g.clone()

        out = fn(handed_out(), dist.group.WORLD)
    got = out.detach().clone().reshape(-1) if torch.is_tensor(out) else out
    return {"got": got, "early": early}


def _shard_judge(world: int, result) -> Miss | None:
    numel, n, per_rank = result
    layout = Layout.of([numel], world)
    local = [sum(_micro_grads(numel, n, r, world)) for r in range(world)]
    mean = sum(local) / world
    for rank, r in enumerate(per_rank):
        got, (start, end) = r["got"], layout.shard(rank)
        if not torch.is_tensor(got) or got.numel() != layout.shard_size:
            size = f"{got.numel()} elements" if torch.is_tensor(got) else type(got).__name__
            return Miss(
                f"rank {rank} returned {size}; its shard has {layout.shard_size} elements.",
                f"rank r keeps elements [r x S, (r + 1) x S) of the padded vector, S = its "
                f"length / W ({layout.padded_numel} / {world} here).",
            )
        if (got - mean[start:end]).abs().max().item() <= TOL:
            continue
        if (got - world * mean[start:end]).abs().max().item() <= TOL:
            return Miss(
                f"rank {rank}'s shard is {world}x the average over the ranks.",
                "a collective SUMS over the ranks; the average is that sum divided by W.",
            )
        for other in range(world):
            lo, hi = layout.shard(other)
            if other != rank and (got - mean[lo:hi]).abs().max().item() <= TOL:
                return Miss(
                    f"rank {rank} returned elements [{lo}, {hi}) of the average (rank {other}'s "
                    f"shard); expected [{start}, {end}).",
                    "rank r owns shard r: slice it with dist.get_rank(group).",
                )
        if (got - local[rank][start:end]).abs().max().item() <= TOL:
            return Miss(
                f"rank {rank} returned the shard of its own gradients, not of their average "
                "over the ranks.",
                "reduce each gradient over the ranks before you keep your part of it.",
            )
        return Miss(
            f"rank {rank}'s shard is off the average over the ranks by up to "
            f"{(got - mean[start:end]).abs().max():.3g}."
        )
    early = per_rank[0]["early"]
    if early:
        k = early[0]
        return Miss(
            f"the right shard, but micro-batch {k + 1}'s gradient was taken before micro-batch "
            f"{k}'s had been reduced: {len(early) + 1} whole gradients were held at once.",
            "reduce inside the loop: each gradient as soon as you receive it, then keep only "
            "your shard of it in a running sum.",
        )
    return None


def check_shard_accumulation(fn: Callable, cluster) -> Verdict:
    """Exercise 1: ``fn(micro_grads, group)`` gets this rank's per-micro-batch gradients (flat,
    padded to a multiple of 2W) one at a time, and returns this rank's shard of their sum
    averaged over the ranks, each gradient reduced before the next one is taken."""
    world = cluster.world_size

    def case(numel: int, n: int):
        return lambda: (numel, n, run_on_ranks(cluster, _shard_case, fn, numel, n))

    return check_cases(
        "a gradient shard, reduced micro-batch by micro-batch",
        [
            (
                f"{n} micro-batch(es), {numel} elements",
                case(numel, n),
                lambda r: _shard_judge(world, r),
            )
            for numel, n in ((58, 1), (58, 3), (43, 2))
        ],
        "for each gradient g: reduce it over the ranks (dist.all_reduce, or "
        "dist.reduce_scatter_tensor, which leaves only your shard of the sum), add your shard "
        "to a running sum; divide by W at the end.",
        where="*Build it in steps* (step 2) and *All-reduce, or reduce-scatter?*",
    )


# ---------------------------------------------------------------- exercise 2: predict the traffic
TRAFFIC = {
    "A": Traffic("deepspeed", 0, False, 3, 0.0),
    "B": Traffic("deepspeed", 1, True, 3, 0.0),
    "C": Traffic("deepspeed", 1, False, 2, 1.0, hidden=5),
    "D": Traffic("gas_lab", 1, False, 2, 1.0, hidden=5, reduce="reduce_scatter"),
    "E": Traffic("deepspeed", 1, False, 2, 1.0, hidden=5,
                 zero=(("use_multi_rank_bucket_allreduce", False),)),
}  # fmt: skip


def _config(t: Traffic) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": t.micro_batches,
        "managed_gradient_accumulation": t.managed,
        "gradient_clipping": t.clipping,
        "zero_optimization": {"stage": t.stage, **dict(t.zero)},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "steps_per_print": 10**9,
    }


def _measure_traffic(t: Traffic) -> dict[str, tuple[int, int]]:
    """On a rank: run ``t`` and count its collectives: {kind: (calls, bytes)}."""
    import functools

    from gas_lab.deepspeed_compat.engine import initialize
    from gas_lab.deepspeed_compat.strategies import strategy_for
    from gas_lab.measure.comm import count_collectives
    from gas_lab.measure.parity import deepspeed_initialize, quiet_deepspeed

    if t.library == "gas_lab":
        init = functools.partial(initialize, strategy=strategy_for(1, reduce=t.reduce))
    else:
        init = deepspeed_initialize()
    model = tiny_model(0, hidden=t.hidden)
    engine = init(model=model, model_parameters=model.parameters(), config=_config(t))[0]
    with count_collectives() as log, quiet_deepspeed():
        for m in range(t.micro_batches):
            x, y = micro_batch(0, 0, m, dist.get_rank(), 2)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            if t.managed:
                engine.step()
        if not t.managed:
            engine.step()
    return {kind: (row["calls"], row["bytes"]) for kind, row in log.by_kind().items()}


def measured_traffic(letter: str, cluster) -> dict[str, tuple[int, int]]:
    """Run ``letter``'s collectives, measured on the ranks (once per session)."""
    return traffic.measured_traffic("lesson05", TRAFFIC, _measure_traffic, letter, cluster)


def _traffic_fix(t: Traffic, world: int, got: dict, want: dict) -> str | None:
    """The fix for the mistake this answer makes, when it is a known one."""
    layout = Layout.of([t.numel], world)
    for kind in ("all_gather", "reduce_scatter"):
        if kind in want and got.get(kind, (0, 0))[1] == want[kind][0] * 4 * t.numel:
            return (
                f"ZeRO works on the PADDED vector: {t.numel} weights are padded to a multiple of "
                f"2W, {layout.padded_numel} elements, before they are cut into {world} shards."
            )
    norm = want.get("all_reduce", (0, 0))
    if t.stage == 1 and t.clipping == 0.0 and got.get("all_reduce") == (norm[0] - 1, norm[1] - 4):
        return (
            "ZeRO-1 all-reduces the 4-byte gradient norm at every step, even with "
            "gradient_clipping 0.0 (stage 0 skips it then)."
        )
    if t.stage == 0 and t.clipping == 0.0 and got.get("all_reduce") == (norm[0] + 1, norm[1] + 4):
        return "stage 0 computes the norm only to clip: with gradient_clipping 0.0 it sends none."
    if dict(t.zero).get("use_multi_rank_bucket_allreduce") is False and got.get(
        "reduce"
    ) != want.get("reduce"):
        return (
            "use_multi_rank_bucket_allreduce false: one reduce per owner, each carrying only the "
            "real elements that owner's shard holds; the padding is never sent."
        )
    return None


def check_traffic_predictions(fn: Callable[[], dict], cluster) -> Verdict:
    """Exercise 2: ``fn()`` returns ``{"A": {"all_reduce": (calls, bytes), ...}, ...}``: per
    run of :data:`TRAFFIC`, every kind of collective with its calls and bytes (the full buffer
    of each call, as ``count_collectives`` counts it), summed over the run, on one rank."""
    return traffic.check_traffic_predictions(
        fn,
        cluster,
        "lesson05",
        TRAFFIC,
        _measure_traffic,
        _traffic_fix,
        "per optimizer step: the gradient reduction (an all-reduce of the real elements, or a "
        "reduce-scatter of the padded vector), a 4-byte norm all-reduce when clipping (and at "
        "stage 1 always), and at stage 1 an all-gather of the padded weights.",
        where="*When each call communicates: the timeline* and *What DeepSpeed 0.19.8's stage 1 "
        "sends, and where it divides*",
    )
