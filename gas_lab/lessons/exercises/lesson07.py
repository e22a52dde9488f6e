"""Checkers for lesson 07's exercises (the capstone's RL-style loop).

1. :func:`check_sequence_mean_loss`: a different objective on the same ragged rollouts: the
   sequence-level mean of GRPO-style trainers (each sequence's token mean, then the mean over
   every sequence of every rank). One process plays W ranks, averages their gradients as
   DeepSpeed's ``step()`` does, and compares with the objective on one big batch.
2. :func:`check_trainer`: a bug hunt. :class:`CachedCountTrainer` is the capstone's loop as a
   trainer object, with one subtle count bug; the checker trains the learner's fixed trainer
   on real DeepSpeed on the notebook's ranks and measures its drift from the one-process
   reference after every step (pass ``cluster``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from gas_lab.accumulate import (
    Batch,
    Window,
    compare_grads,
    full_batch_gradient,
    grads_of,
    token_losses,
)
from gas_lab.dp import global_count
from gas_lab.lessons.exercises.on_ranks import run_on_ranks
from gas_lab.lessons.exercises.verdict import Miss, Verdict, check_cases
from gas_lab.lessons.exercises.verdict import hint as hint  # lessonNN.hint()
from gas_lab.lessons.rollouts import capstone_config, reference_run, rollouts, to_device
from gas_lab.toys import TinyTransformer, flat_params

TOL = 1e-5  # max relative gradient (or absolute parameter) error accepted; float32 is ~1e-7


# ---------------------------------------------------------------- exercise 1: the sequence mean
def _counts(per_rank: list[list[Batch]]) -> dict:
    return {
        "all_sequences": sum(Window.of(mbs).n_samples for mbs in per_rank),
        "all_tokens": sum(Window.of(mbs).n_tokens for mbs in per_rank),
        "world_size": len(per_rank),
    }


def _rank_averaged_gradient(per_rank: list[list[Batch]], loss_of: Callable) -> dict:
    """What DeepSpeed's ``step()`` applies, on one process: each rank's summed gradient of
    ``loss_of(token_losses, mask, rank_sequences, counts)`` over its micro-batches, averaged."""
    counts, grads = _counts(per_rank), []
    for mbs in per_rank:
        model, rank_sequences = TinyTransformer(3), Window.of(mbs).n_samples
        for mb in mbs:
            loss = loss_of(token_losses(model, mb), mb.mask, rank_sequences, *counts.values())
            if not (torch.is_tensor(loss) and loss.requires_grad):
                raise TypeError("the loss carries no gradient: return a tensor, not .item()")
            loss.backward()
        grads.append(grads_of(model))
    return {k: sum(g[k] for g in grads) / len(per_rank) for k in grads[0]}


def _sequence_means(tl, mask):
    return (tl * mask).sum(1) / mask.sum(1)


# The wrong answers the judge recognises, in the exercise's signature.
def _token_mean(tl, m, rank_sequences, all_sequences, all_tokens, world_size):
    return (tl * m).sum() / all_tokens * world_size


def _own_sequences(tl, m, rank_sequences, all_sequences, all_tokens, world_size):
    return _sequence_means(tl, m).sum() / rank_sequences


def _micro_batch_mean(tl, m, rank_sequences, all_sequences, all_tokens, world_size):
    return (tl * m).sum() / m.sum() * len(m) / all_sequences * world_size


_MISTAKES = {
    "per-token": _token_mean,
    "own sequences": _own_sequences,
    "micro-batch mean": _micro_batch_mean,
}


def _sequence_case(fn: Callable, world_size: int, step: int) -> Callable[[], dict]:
    def run() -> dict:
        per_rank = [rollouts(step, r, seed=7) for r in range(world_size)]
        every = [mb for mbs in per_rank for mb in mbs]
        big = Batch(*(torch.cat([getattr(m, k) for m in every]) for k in ("x", "y", "mask")))
        return {
            "got": _rank_averaged_gradient(per_rank, fn),
            "ref": full_batch_gradient(TinyTransformer(3), big, token_losses, "sequence"),
            "per_rank": per_rank,
        }

    return run


def _judge_sequence(r: dict) -> Miss | None:
    got, ref, per_rank = r["got"], r["ref"], r["per_rank"]
    err = compare_grads(got, ref)
    if err.max_rel < TOL:
        return None
    w, off = len(per_rank), f"off by {err.max_rel:.1%} (max relative)"
    # The right direction, a wrong size? Project the gradient on the reference's direction.
    dot = sum((got[k].double() * ref[k].double()).sum() for k in ref)
    factor = (dot / sum(ref[k].double().pow(2).sum() for k in ref)).item()
    if compare_grads(got, {k: v * factor for k, v in ref.items()}).max_rel < TOL:
        if abs(factor * w - 1) < 1e-3:
            return Miss(
                f"the right direction, but the step's gradient is 1/{w} of the objective's, "
                f"with {w} ranks.",
                f"DeepSpeed AVERAGES the {w} ranks' gradients: multiply the loss by world_size.",
            )
        return Miss(f"the right direction, but {factor:.3g} x the objective's size.")
    for name, mistake in _MISTAKES.items():
        if compare_grads(got, _rank_averaged_gradient(per_rank, mistake)).max_rel >= TOL:
            continue
        return {
            "per-token": Miss(
                f"long sequences weigh more than short ones: your gradient is the per-token "
                f"objective's, {off}.",
                "average each row over its own real tokens first: (tl * mask).sum(1) / "
                "mask.sum(1).",
            ),
            "own sequences": Miss(
                f"with ranks of different sizes, each rank's sequences together weigh the same "
                f"as every other rank's; {off}.",
                "divide by the step's sequences on ALL ranks (all_sequences), not this rank's.",
            ),
            "micro-batch mean": Miss(
                f"every token of a micro-batch weighs the same, whatever its sequence's length; "
                f"{off}.",
                "take each sequence's (row's) mean over its own real tokens, not the micro-batch's.",
            ),
        }[name]
    return Miss(f"the gradient differs from the sequence-mean objective's: {err}.")


def check_sequence_mean_loss(fn: Callable) -> Verdict:
    """Exercise 1: ``fn(token_losses, mask, rank_sequences, all_sequences, all_tokens,
    world_size)`` -> the scalar one micro-batch hands to ``engine.backward(loss,
    scale_wrt_gas=False)`` for the sequence-level mean over every sequence of every rank."""
    cases = [
        ("1 rank", _sequence_case(fn, 1, 1), _judge_sequence),
        ("2 ranks with very different token counts", _sequence_case(fn, 2, 3), _judge_sequence),
        ("3 ranks", _sequence_case(fn, 3, 1), _judge_sequence),
    ]
    return check_cases(
        "a sequence-level mean on ragged ranks",
        cases,
        "every SEQUENCE of the step weighs the same, and its tokens share its weight: a row's "
        "loss is its mean over its own real tokens; every row of the step weighs one over the "
        "step's sequences on every rank; and DeepSpeed's average over ranks is undone once.",
        where="section 1 (*The idea*): the same reasoning, with tokens instead of sequences",
    )


# ---------------------------------------------------------------- exercise 2: find the bug
class CachedCountTrainer:
    """The capstone's loop as a trainer object: call ``train_step`` once per optimizer step,
    on every rank, with the micro-batches that finished on this rank."""

    def __init__(self, engine):
        self.engine = engine
        self.world = dist.get_world_size()
        self.tokens = None  # the step's real tokens on all ranks

    def train_step(self, micro_batches):
        if self.tokens is None:  # one all-reduce, not one per micro-batch
            self.tokens = global_count(sum(int(mb.mask.sum()) for mb in micro_batches))
        for mb in micro_batches:
            loss = (token_losses(self.engine, mb) * mb.mask).sum() / self.tokens * self.world
            self.engine.backward(loss, scale_wrt_gas=False)
        self.engine.step()


STEPS = 4
CONFIG = capstone_config(stage=1, clip=0.0)


def _trainer_run(trainer_cls, steps: int) -> dict:
    """On a rank: a DeepSpeed engine, the learner's trainer, ``steps`` steps of rollouts."""
    from gas_lab.measure.parity import deepspeed_initialize

    model = TinyTransformer(0)
    engine = deepspeed_initialize()(
        model=model, model_parameters=model.parameters(), config=CONFIG
    )[0]
    trainer, params, tokens = trainer_cls(engine), [], []
    for step in range(steps):
        micro = [to_device(mb, engine.device) for mb in rollouts(step, dist.get_rank())]
        tokens.append(Window.of(micro).n_tokens)
        trainer.train_step(micro)
        params.append(flat_params(engine.module))
    return {"params": params, "tokens": tokens}


def check_trainer(fn: Callable, cluster) -> Verdict:
    """Exercise 2: ``fn(engine)`` builds a trainer (``CachedCountTrainer`` fixed) whose
    ``train_step(micro_batches)`` follows the one-big-batch reference at every step."""
    world = cluster.world_size
    measured: dict = {}

    def run():  # one training run on the ranks, judged step by step
        if "per_rank" not in measured:
            measured["per_rank"] = run_on_ranks(cluster, _trainer_run, fn, STEPS, timeout=300)
            measured["reference"] = reference_run(CONFIG, STEPS, world_size=world)["params"]
        return measured

    def after(step: int):
        def judge(m) -> Miss | None:
            per_rank, reference = m["per_rank"], m["reference"]
            drift = [
                max((r["params"][s] - reference[s]).abs().max().item() for r in per_rank)
                for s in range(STEPS)
            ]
            if drift[step] <= TOL:
                return None
            shown = ", ".join(f"{d:.1e}" for d in drift)
            lead = (
                f"drift from the reference after each step: {shown} (float32 rounding: < {TOL:g})"
            )
            if step > 0:
                return Miss(
                    f"{lead}. Step 1 is right and step {step + 1} is not.",
                    f"what does step {step + 1} use that still comes from step 1? Each step has "
                    "its own rollouts, so its own token count: all-reduce it every step, on "
                    "every rank, before the step's first backward.",
                )
            return Miss(f"{lead}. Already the first step is wrong.")

        return judge

    return check_cases(
        "the trainer that drifts",
        [(f"after step {s + 1} of {STEPS}", run, after(s)) for s in range(STEPS)],
        "each step has its own rollouts, so its own token count: all-reduce it every step, on "
        "every rank, before the step's first backward (one all-reduce per step is the price).",
        where="section 4 (*Build it inline: one step on the ranks*): what the loop counts, and when",
    )
