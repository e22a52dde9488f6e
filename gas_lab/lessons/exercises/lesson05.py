"""Checkers for lesson 05's exercises (ZeRO: shards, reductions, what each step sends).

1. :func:`check_shard_accumulation`: accumulate gradients the way stage 2 must (the lesson
   counted it on DeepSpeed, but built only stage 1): reduce-scatter every micro-batch's
   gradient as it comes and keep only your shard between micro-batches. The checker hands the
   gradients out one at a time and counts the collectives.
2. :func:`check_traffic_predictions`: predict the collectives (calls and bytes, per kind) of
   optimizer steps the lesson did not measure: no clipping, a model whose size needs padding,
   the reduce-scatter variant, two steps. The checker measures each on the notebook's ranks.

Both take the notebook's ``cluster``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gas_lab.lessons.exercises.on_ranks import measured_once, run_on_ranks
from gas_lab.lessons.exercises.verdict import Verdict, answer_for, check_cases
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


def _handed_out_when_reduced(grads: list[torch.Tensor], log):
    """Yield gradient k only once k collectives have run: the previous gradient was reduced
    (and could be freed) before the next backward produced its gradient."""
    for k, g in enumerate(grads):
        if len(log) < k:
            raise RuntimeError(
                f"micro-batch {k + 1}'s gradient was asked for before micro-batch {k}'s was "
                "reduced: stage 2 keeps no full gradient between backward passes, so each one "
                "must be reduce-scattered as soon as it exists"
            )
        yield g.clone()


def _shard_case(fn: Callable, numel: int, n: int) -> dict:
    from gas_lab.measure.comm import count_collectives

    rank, world = dist.get_rank(), dist.get_world_size()
    with count_collectives() as log:
        out = fn(
            _handed_out_when_reduced(_micro_grads(numel, n, rank, world), log), dist.group.WORLD
        )
    got = out.detach().clone().reshape(-1) if torch.is_tensor(out) else out
    return {"got": got, "calls": [(c.kind, c.bytes) for c in log.calls]}


def check_shard_accumulation(fn: Callable, cluster) -> Verdict:
    """Exercise 1: ``fn(micro_grads, group)`` gets this rank's per-micro-batch gradients (flat,
    padded to a multiple of the world size) one at a time, and returns this rank's shard of the
    accumulated gradient averaged over ranks, reducing every micro-batch's gradient at once."""
    world = cluster.world_size

    def case(numel: int, n: int):
        return lambda: (numel, n, run_on_ranks(cluster, _shard_case, fn, numel, n))

    def judge(result) -> str | None:
        numel, n, per_rank = result
        layout = Layout.of([numel], world)
        local = [sum(_micro_grads(numel, n, r, world)) for r in range(world)]
        mean = sum(local) / world
        for rank, r in enumerate(per_rank):
            got, (start, end) = r["got"], layout.shard(rank)
            if not torch.is_tensor(got) or got.numel() != layout.shard_size:
                size = got.numel() if torch.is_tensor(got) else type(got).__name__
                return (
                    f"rank {rank} returned {size} elements; its shard has {layout.shard_size} "
                    f"(the padded {layout.padded_numel} / {world} ranks)."
                )
            if (got - mean[start:end]).abs().max().item() <= TOL:
                continue
            if (got - world * mean[start:end]).abs().max().item() <= TOL:
                return (
                    f"rank {rank}'s shard is {world}x the mean: that is the sum; divide by {world}."
                )
            for other in range(world):
                lo, hi = layout.shard(other)
                if other != rank and (got - mean[lo:hi]).abs().max().item() <= TOL:
                    return f"rank {rank} returned rank {other}'s shard: rank r owns shard r."
            if (got - local[rank][start:end]).abs().max().item() <= TOL:
                return f"rank {rank} returned its own, unreduced gradient: reduce over ranks."
            return f"rank {rank}'s shard is off by {(got - mean[start:end]).abs().max():.3g}."
        calls = per_rank[0]["calls"]
        full = layout.padded_numel * 4
        if calls == [("reduce_scatter", full)] * n:
            return None
        kinds = sorted({kind for kind, _ in calls})
        if kinds == ["all_reduce"]:
            return (
                f"right shard, but {len(calls)} all-reduces: each sends every rank the WHOLE "
                f"reduced gradient, where a reduce-scatter gives each rank only its shard "
                f"(half the traffic on a ring: (W-1)/W of the buffer instead of 2(W-1)/W)."
            )
        return f"right shard; collectives {calls}, expected {n} reduce_scatter of {full} bytes."

    return check_cases(
        "a gradient shard, reduced micro-batch by micro-batch",
        [
            (f"{n} micro-batch(es), {numel} elements", case(numel, n), judge)
            for numel, n in ((58, 1), (58, 3), (43, 2))
        ],
        "for each gradient: out = torch.empty(g.numel() // W); dist.reduce_scatter_tensor(out, "
        "g, group=group) (shard r of the SUM lands on rank r); add out into your shard; at the "
        "end divide by W.",
    )


# ---------------------------------------------------------------- exercise 2: predict the traffic
@dataclass(frozen=True)
class Traffic:
    """An optimizer run whose collectives the learner predicts (summed over the run)."""

    library: str  # "deepspeed", or "gas_lab" for ZeRO-1 with a reduce-scatter
    stage: int
    managed: bool
    micro_batches: int  # per optimizer step (= GAS when managed)
    clipping: float
    hidden: int = 8  # tiny_model's hidden width: 8 gives the lesson's 58 weights
    steps: int = 1

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in tiny_model(0, hidden=self.hidden).parameters())

    def show(self) -> str:
        mode = "managed" if self.managed else "unmanaged"
        reduce = ", gradients reduce-scattered" if self.library == "gas_lab" else ""
        return (
            f"{self.library}, ZeRO stage {self.stage}{reduce}, {mode}, {self.micro_batches} "
            f"micro-batches per step, gradient_clipping {self.clipping}, a model of "
            f"{self.numel} weights, {self.steps} optimizer step(s)"
        )


TRAFFIC = {
    "A": Traffic("deepspeed", 0, False, 3, 0.0),
    "B": Traffic("deepspeed", 1, True, 3, 0.0),
    "C": Traffic("deepspeed", 1, False, 2, 1.0, hidden=5),
    "D": Traffic("gas_lab", 1, False, 2, 1.0, hidden=5),
    "E": Traffic("deepspeed", 1, True, 2, 1.0, steps=2),
}


def _config(t: Traffic) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": t.micro_batches,
        "managed_gradient_accumulation": t.managed,
        "gradient_clipping": t.clipping,
        "zero_optimization": {"stage": t.stage},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "steps_per_print": 10**9,
    }


def _measure_traffic(t: Traffic) -> dict[str, tuple[int, int]]:
    """On a rank: run ``t`` and count its collectives: {kind: (calls, bytes)}."""
    import functools

    from gas_lab.deepspeed_compat.engine import initialize
    from gas_lab.deepspeed_compat.strategies import strategy_for
    from gas_lab.measure.comm import count_collectives
    from gas_lab.measure.parity import deepspeed_initialize

    if t.library == "gas_lab":
        init = functools.partial(initialize, strategy=strategy_for(1, reduce="reduce_scatter"))
    else:
        init = deepspeed_initialize()
    model = tiny_model(0, hidden=t.hidden)
    engine = init(model=model, model_parameters=model.parameters(), config=_config(t))[0]
    with count_collectives() as log:
        for step in range(t.steps):
            for m in range(t.micro_batches):
                x, y = micro_batch(0, step, m, dist.get_rank(), 2)
                engine.backward(torch.nn.functional.mse_loss(engine(x), y))
                if t.managed:
                    engine.step()
            if not t.managed:
                engine.step()
    return {kind: (row["calls"], row["bytes"]) for kind, row in log.by_kind().items()}


def measured_traffic(letter: str, cluster) -> dict[str, tuple[int, int]]:
    """Run ``letter``'s collectives, measured on the ranks (once per session)."""
    return measured_once(
        ("lesson05 traffic", letter, cluster.world_size),
        lambda: cluster.run(_measure_traffic, TRAFFIC[letter], timeout=300)[0],
    )


def _traffic_case(fn: Callable, letter: str, cluster):
    t = TRAFFIC[letter]

    def run():
        got = answer_for(fn, letter, "{'A': {'all_reduce': (1, 232)}, ...}")
        return got, measured_traffic(letter, cluster)

    def judge(result) -> str | None:
        got, want = result
        if not isinstance(got, dict):
            return f"answer a dict {{kind: (calls, bytes)}}, got {got!r}."
        got = {k: tuple(int(v) for v in cb) for k, cb in got.items() if tuple(cb) != (0, 0)}
        if got == want:
            return None
        said = f"you said {got}, measured {want}"
        layout = Layout.of([t.numel], cluster.world_size)
        if any(
            k in want and got.get(k) == (want[k][0], t.numel * 4)
            for k in ("all_gather", "reduce_scatter")
        ):
            return (
                f"{said}: ZeRO works on the PADDED vector: {t.numel} weights padded to "
                f"{layout.padded_numel} ({layout.padded_numel * 4} bytes) for {cluster.world_size} shards."
            )
        norm = want.get("all_reduce", (0, 0))
        if (
            t.stage == 1
            and t.clipping == 0.0
            and got.get("all_reduce") == (norm[0] - t.steps, norm[1] - 4 * t.steps)
        ):
            return (
                f"{said}: ZeRO-1 all-reduces the 4-byte gradient norm at every step even with "
                "gradient_clipping 0.0 (stage 0 skips it): measured, not documented."
            )
        if t.steps > 1 and all(want[k][0] % t.steps == 0 for k in want):
            per_step = {k: (c // t.steps, b // t.steps) for k, (c, b) in want.items()}
            if got == per_step:
                return f"{said}: that is one step's traffic; the run has {t.steps} steps."
        return f"{said}."

    return (f"run {letter}", run, judge)


def check_traffic_predictions(fn: Callable[[], dict], cluster) -> Verdict:
    """Exercise 2: ``fn()`` returns ``{"A": {"all_reduce": (calls, bytes), ...}, ...}``: per
    run of :data:`TRAFFIC`, every kind of collective with its calls and bytes (the full buffer
    of each call, as ``count_collectives`` counts it), summed over the run, on one rank."""
    return check_cases(
        "predict the traffic",
        [_traffic_case(fn, letter, cluster) for letter in TRAFFIC],
        "per optimizer step: the gradient reduction (all-reduce of the model's bytes, or "
        "reduce-scatter of the padded vector), a 4-byte norm all-reduce when clipping (and at "
        "stage 1 always), and at stage 1 an all-gather of the padded weights.",
    )
