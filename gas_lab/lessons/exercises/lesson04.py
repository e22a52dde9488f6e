"""Checkers for lesson 04's exercises (unmanaged accumulation on real DeepSpeed, on the ranks).

1. :func:`check_sample_weights`: ranks run different numbers of micro-batches AND the
   micro-batches hold different numbers of samples (a ragged last micro-batch per rank). The
   lesson's divisor weighs every *micro-batch* the same; here every *sample* must. The checker
   trains an unmanaged DeepSpeed engine on every rank with the learner's losses and compares
   with one process that takes every sample of the step in one mean.
2. :func:`check_rpc_step`: a bug hunt. :func:`hanging_step` is right when every rank runs the
   same number of micro-batches and hangs when they differ; the checker counts each step's
   collectives and runs the ragged cases with a short timeout.

Both take the notebook's ``cluster``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from gas_lab.dp import global_count
from gas_lab.lessons.exercises.on_ranks import run_on_ranks
from gas_lab.lessons.exercises.verdict import Miss, Verdict, check_cases
from gas_lab.lessons.exercises.verdict import hint as hint  # lessonNN.hint()
from gas_lab.measure.parity import reference_params
from gas_lab.runtime.rank_errors import RankError, RankStallError
from gas_lab.toys import flat_params, micro_batch, tiny_model

TOL = 1e-6
LR = 0.1
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,  # nominal: these loops run other numbers on purpose
    "managed_gradient_accumulation": False,
    "gradient_clipping": 0.0,
    "optimizer": {"type": "SGD", "params": {"lr": LR}},
    "steps_per_print": 10**9,
}


# A right handler runs a case's steps in well under a second once DeepSpeed is started (the
# solution: 0.6 s for all its cases), so a case still running after 5 s has hung.
HANG_TIMEOUT = 5.0


def _start_deepspeed() -> None:
    """On a rank: import DeepSpeed and start its communication layer (tens of seconds on fresh
    ranks, nothing afterwards), so that the timeouts below time the learner's loop only."""
    from gas_lab.measure.parity import deepspeed_initialize

    deepspeed_initialize()
    import deepspeed

    deepspeed.init_distributed(dist_backend=dist.get_backend())


def _engine():
    from gas_lab.measure.parity import deepspeed_initialize

    model = tiny_model(0)
    engine, *_ = deepspeed_initialize()(
        model=model, model_parameters=model.parameters(), config=CONFIG
    )
    return engine


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _widen(table: list[list], world: int, fill) -> list[list]:
    """The cases are written for the lessons' 2 ranks; more ranks get ``fill`` (None: a copy
    of the last rank's entry)."""
    return [row + [row[-1] if fill is None else fill] * (world - len(row)) for row in table]


# ---------------------------------------------------------------- exercise 1: weigh samples
def _per_sample_losses(engine, pairs) -> list[torch.Tensor]:
    return [
        torch.nn.functional.mse_loss(engine(x), y, reduction="none").mean(dim=1) for x, y in pairs
    ]


def _lessons_divisor(losses):  # every micro-batch weighs the same (lesson 04's global_n)
    divisor = global_count(len(losses)) / dist.get_world_size()
    return [x.mean() / divisor for x in losses]


def _own_samples(losses):  # every rank weighs the same
    samples = sum(len(x) for x in losses)
    return [x.sum() / samples for x in losses]


def _no_world_size(losses):  # forgets that step() averages the ranks
    samples = global_count(sum(len(x) for x in losses))
    return [x.sum() / samples for x in losses]


# The classic mistakes (each counts once per step: a collective per micro-batch would hang).
_WRONG = {"lesson": _lessons_divisor, "own samples": _own_samples, "no world size": _no_world_size}


def _sample_runs(fn: Callable, table) -> dict:
    """On a rank: one DeepSpeed run with the learner's losses, one per classic mistake."""
    rank, out = dist.get_rank(), {}
    for name, losses_of in {"learner": fn, **_WRONG}.items():
        engine = _engine()
        for step, row in enumerate(table):
            pairs = [micro_batch(0, step, m, rank, size) for m, size in enumerate(row[rank])]
            losses = list(losses_of(_per_sample_losses(engine, pairs)))
            if len(losses) != len(pairs):
                raise ValueError(
                    f"return one loss per micro-batch ({len(pairs)}), not {len(losses)}"
                )
            for loss in losses:
                engine.backward(loss, scale_wrt_gas=False)
            engine.step()
        out[name] = flat_params(engine.module)
    return out


def _sample_reference(table) -> torch.Tensor:
    """One process, no engine: every sample of every rank in one mean loss, one SGD step."""
    model = tiny_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step, row in enumerate(table):
        pairs = [
            micro_batch(0, step, m, rank, size)
            for rank, sizes in enumerate(row)
            for m, size in enumerate(sizes)
        ]
        x, y = (torch.cat(t) for t in zip(*pairs, strict=True))
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return flat_params(model)


def check_sample_weights(fn: Callable, cluster) -> Verdict:
    """Exercise 1: ``fn(losses)`` runs on every rank with this step's per-sample loss tensors,
    one per micro-batch (their lengths differ), and returns one scalar per micro-batch for
    ``engine.backward(..., scale_wrt_gas=False)``: every sample of every rank weighs the same."""
    world = cluster.world_size

    def case(table):
        def run():
            cluster.run(_start_deepspeed, timeout=300)
            return table, run_on_ranks(cluster, _sample_runs, fn, table)

        return run

    def judge(result) -> str | Miss | None:
        table, per_rank = result
        ref = _sample_reference(table)
        err = max(_max_diff(r["learner"], ref) for r in per_rank)
        if err <= TOL:
            return None
        sizes = "; ".join(f"rank {r}: {row}" for r, row in enumerate(table[0]))
        differs = (
            f"the parameters are {err:.2g} from the reference where every sample weighs the "
            f"same (samples per micro-batch in step 0: {sizes})"
        )
        same = {k for k in _WRONG if all(_max_diff(r["learner"], r[k]) <= TOL for r in per_rank)}
        if "lesson" in same:
            return Miss(
                f"{differs}; yours weigh every MICRO-BATCH the same.",
                "the micro-batches hold different numbers of samples: count this rank's "
                "samples, not its micro-batches, and give each micro-batch its sum of losses.",
            )
        if "own samples" in same:
            return Miss(
                f"{differs}; yours weigh every RANK the same.",
                "each rank divided by its own samples, then DeepSpeed averaged the ranks: "
                "global_count() the samples of every rank first.",
            )
        if "no world size" in same:
            return Miss(
                f"{differs}; your update is {world}x too small.",
                f"DeepSpeed's all-reduce divides by the world size ({world}) too: divide by "
                "(all samples / world size).",
            )
        return f"{differs}."

    tables = {
        "equal micro-batches, same count on every rank": [[[2, 2], [2, 2]], [[2, 2, 2], [2, 2, 2]]],
        "a ragged last micro-batch": [[[2, 2, 1], [2, 2]], [[2, 1], [2, 2, 2]]],
        "a rank with no micro-batches": [[[2, 2, 1], []], [[], [1, 2, 2]]],
    }
    return check_cases(
        "every sample weighs the same",
        [(name, case(_widen(t, world, [])), judge) for name, t in tables.items()],
        "count this rank's SAMPLES, global_count() them (every rank, even one with no "
        "micro-batches), and give each micro-batch losses.sum() / (all samples / world size): "
        "DeepSpeed's step() then divides by the world size again.",
        where="*Pitfall 2: ranks with different N* (`global_count`, `global_n`)",
    )


# ---------------------------------------------------------------- exercise 2: find the hang
def hanging_step(engine, micro_batches, loss_fn):
    """One RPC step on an unmanaged engine: a backward() per micro-batch, then one step(),
    every micro-batch of every rank weighing the same. Hangs when ranks run different N."""
    for x, y in micro_batches:
        divisor = global_count(len(micro_batches)) / dist.get_world_size()
        engine.backward(loss_fn(engine(x), y) / divisor, scale_wrt_gas=False)
    if micro_batches:  # nothing to apply on this rank
        engine.step()


def _rpc_run(fn: Callable, table) -> dict:
    """On a rank: the learner's handler for every step of ``table``, collectives counted."""
    from gas_lab.measure.comm import count_collectives

    rank, engine, per_step = dist.get_rank(), _engine(), []
    for step, row in enumerate(table):
        batches = [micro_batch(0, step, m, rank, 2) for m in range(row[rank])]
        with count_collectives() as log:
            fn(engine, batches, torch.nn.functional.mse_loss)
        per_step.append([c.bytes for c in log.calls if c.kind == "all_reduce"])
    return {"params": flat_params(engine.module), "all_reduces": per_step}


def check_rpc_step(fn: Callable, cluster) -> Verdict:
    """Exercise 2: ``fn(engine, micro_batches, loss_fn)``, :func:`hanging_step` fixed: right
    parameters for any N per rank (0 included), with one count all-reduce and one gradient
    all-reduce per step on every rank."""
    world = cluster.world_size

    def case(table):
        def run():
            cluster.run(_start_deepspeed, timeout=300)
            try:
                return table, run_on_ranks(cluster, _rpc_run, fn, table, timeout=HANG_TIMEOUT)
            except (RankError, RankStallError) as err:  # mismatched collectives: the hang
                return table, err

        return run

    def judge(result) -> str | None:
        table, per_rank = result
        ns = "; ".join(f"step {s}: {row}" for s, row in enumerate(table))
        if isinstance(per_rank, RankError | RankStallError):
            return Miss(
                f"the ranks hung (N per rank: {ns}): {str(per_rank).splitlines()[0]}",
                "every rank must issue the same collectives, in the same order, whatever its N: "
                "count which ones each rank issues, step() included.",
            )
        for step, calls in enumerate(per_rank[0]["all_reduces"]):
            counts = [b for b in calls if b == 8]  # global_count: one float64
            if len(counts) != 1:
                n = table[step][0]
                return Miss(
                    f"rank 0 all-reduced the count {len(counts)} times in step {step} (N = {n}); "
                    "expected once per step.",
                    "a rank with another N would issue another number of collectives and the "
                    "ranks would stop pairing up: count once per step, before the loop.",
                )
            if len(calls) != 2:
                return f"{len(calls)} all-reduces in step {step}; expected 2 (the count, the gradient)."
        ref = reference_params(CONFIG, len(table), lambda s, r: table[s][r], world)
        err = max(_max_diff(r["params"], ref) for r in per_rank)
        if err > TOL:
            return f"the parameters are {err:.2g} from the reference (N per rank: {ns})."
        return None

    tables = {
        "same N on every rank": [[2, 2], [3, 3]],
        "N differs between ranks": [[3, 1], [1, 4]],
        "a rank with nothing to do": [[2, 0], [0, 3]],
    }
    return check_cases(
        "an RPC step that cannot hang",
        [(name, case(_widen(t, world, None)), judge) for name, t in tables.items()],
        "a collective is a meeting every rank must attend: any all-reduce inside a loop over "
        "this rank's micro-batches, or behind an `if` on them, runs a different number of "
        "times on a rank with another N. step() all-reduces too.",
        where="*Where the communication happens, per ZeRO stage* and the handler `serve`",
    )
