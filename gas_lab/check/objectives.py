"""What a step's loss should be, and the ways real loops get it wrong, as weights per token.

Every normalization the checker knows is linear in the per-token cross-entropies: a rank's
micro-batch loss is ``sum(weight * cross_entropy)`` over its tokens (a label of -100 has no
cross-entropy). The engine then averages the ranks' gradients, so the step follows

    objective = (1 / W) * sum over ranks, micro-batches and tokens of weight * cross_entropy

A :class:`Normalization` is a recipe for those weights: what the loss of a micro-batch is divided
by (its :class:`Denominator`), times the world size W or not, divided by a constant or not. The
declared objective is one recipe (:func:`objective`); every other recipe is a mistake a loop can
make, and :mod:`gas_lab.check.diagnosis` replays them to name the one a loop made.

The objectives (``--reduction``):

* ``token``: the mean cross-entropy over every label that is not -100, on every rank, in every
  micro-batch of the step (Hugging Face's ``num_items_in_batch``, verl's token-mean).
* ``sequence``: the mean, over sequences, of each sequence's own token mean (verl's
  seq-mean-token-mean).
* ``sum``: the total.
* ``token-sum/sequences``: the total divided by the number of sequences (verl's
  seq-mean-token-sum, TRL's Dr. GRPO).

A sequence whose labels are all -100 is not a sequence for these counts, unless
``count_empty_sequences`` (verl's convention): then it counts, with a mean of 0. ``constant``
divides any objective by a fixed number (Dr. GRPO's maximum length).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100  # Hugging Face's label for "no target here"
REDUCTIONS = ("token", "sequence", "sum", "token-sum/sequences")


@dataclass(frozen=True)
class Step:
    """One optimizer step's data: ``ranks[r]`` is rank r's list of micro-batches (dicts with
    ``input_ids``, ``labels``, ``attention_mask``); ``before`` is the labelled-token count of
    the earlier steps of the same run (for the mistake of carrying a count over)."""

    ranks: tuple[tuple[dict, ...], ...]
    before: int = 0

    @property
    def world_size(self) -> int:
        return len(self.ranks)


def labelled(mb: dict) -> torch.Tensor:
    """1.0 where a label is a target, 0.0 where it is -100, shape [B, T]."""
    return (mb["labels"] != IGNORE).float()


def _sequences(mb: dict, count_empty: bool) -> torch.Tensor:
    """Per sequence of ``mb``: 1.0 if it counts as a sequence, shape [B]."""
    return torch.ones(mb["labels"].shape[0]) if count_empty else (labelled(mb).sum(1) > 0).float()


# Each denominator: (words for a learner, per-token divisor for micro-batch ``mb`` of rank ``r``).
# A divisor is a tensor [B, T] (or a number); "per sequence" ones use each sequence's own count.
def _per_sequence_tokens(mb: dict) -> torch.Tensor:
    return labelled(mb).sum(1, keepdim=True).clamp(min=1).expand_as(mb["labels"])


@dataclass(frozen=True)
class Denominator:
    name: str
    words: str
    per_sequence: bool = False  # each token is also divided by its own sequence's token count
    local: bool = False  # counted on this rank only (or this micro-batch), not on every rank

    def divisor(self, step: Step, r: int, m: int, count_empty: bool) -> torch.Tensor | float:
        mb = step.ranks[r][m]
        every = [x for rank in step.ranks for x in rank]
        mine = step.ranks[r]
        n = self.name
        if n == "one":
            d = 1.0
        elif n == "tokens":
            d = float(sum(labelled(x).sum() for x in every))
        elif n == "tokens so far":
            d = float(sum(labelled(x).sum() for x in every)) + step.before
        elif n == "rank tokens":
            d = float(sum(labelled(x).sum() for x in mine))
        elif n == "attended":
            d = float(sum(x["attention_mask"].sum() for x in every))
        elif n == "rank attended":
            d = float(sum(x["attention_mask"].sum() for x in mine))
        elif n == "micro-batch tokens":
            d = float(labelled(mb).sum())
        elif n == "micro-batch tokens x rank micro-batches":
            d = float(labelled(mb).sum()) * len(mine)
        elif n == "micro-batch tokens x micro-batches":
            d = float(labelled(mb).sum()) * len(every)
        elif n in ("sequences", "sequence means"):
            d = float(sum(_sequences(x, count_empty).sum() for x in every))
        elif n in ("rank sequences", "rank sequence means"):
            d = float(sum(_sequences(x, count_empty).sum() for x in mine))
        else:
            raise ValueError(f"unknown denominator {n!r}")
        return d * _per_sequence_tokens(mb) if self.per_sequence else d


DENOMINATORS = {
    d.name: d
    for d in (
        Denominator("one", "nothing"),
        Denominator("tokens", "every rank's labelled tokens"),
        Denominator("tokens so far", "every rank's labelled tokens of this step and the steps before it"),
        Denominator("rank tokens", "this rank's own labelled tokens", local=True),
        Denominator("attended", "every rank's attended positions (attention_mask), prompt and all"),
        Denominator("rank attended", "this rank's own attended positions (attention_mask)", local=True),
        Denominator("micro-batch tokens", "the micro-batch's own labelled tokens (a sum of micro-batch means)", local=True),
        Denominator("micro-batch tokens x rank micro-batches", "the micro-batch's own labelled tokens and this rank's number of micro-batches (a mean of micro-batch means)", local=True),
        Denominator("micro-batch tokens x micro-batches", "the micro-batch's own labelled tokens and every rank's number of micro-batches (a mean of micro-batch means over all ranks)", local=True),
        Denominator("sequences", "every rank's number of sequences"),
        Denominator("rank sequences", "this rank's own number of sequences", local=True),
        Denominator("sequence means", "every rank's number of sequences, each token by its sequence's tokens", per_sequence=True),
        Denominator("rank sequence means", "this rank's own number of sequences, each token by its sequence's tokens", per_sequence=True, local=True),
    )
}  # fmt: skip

# The declared objective, as a denominator with the world-size factor (it undoes the engine's
# average over ranks: each rank's share is a part of one global sum, not a mean of its own).
_OBJECTIVE_DENOMINATOR = {
    "token": "tokens",
    "sequence": "sequence means",
    "sum": "one",
    "token-sum/sequences": "sequences",
}


@dataclass(frozen=True)
class Normalization:
    """How a loop turns a micro-batch's token cross-entropies into the loss it backpropagates."""

    denominator: str
    times_world: bool = True  # multiplied by the world size (undoes the engine's average)
    constant: float = 1.0  # divided by this too
    gas: int = 1  # divided by this too (backward()'s scale_wrt_gas with GAS > 1)
    count_empty: bool = False  # a sequence without labels counts as a sequence

    def weights(self, step: Step, r: int, m: int) -> torch.Tensor:
        """Per-token weight of micro-batch ``m`` of rank ``r``: shape [B, T], 0 where no label."""
        mb = step.ranks[r][m]
        den = DENOMINATORS[self.denominator].divisor(step, r, m, self.count_empty)
        scale = (step.world_size if self.times_world else 1.0) / (self.constant * self.gas)
        if isinstance(den, float) and den == 0.0:
            return torch.full(mb["labels"].shape, float("nan")) * labelled(mb)
        return labelled(mb) * scale / den


def objective(reduction: str, constant: float = 1.0, count_empty: bool = False) -> Normalization:
    """The right normalization for a declared objective. (A right loop also undoes what
    ``engine.backward(loss)`` divides by when gradient_accumulation_steps > 1.)"""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction {reduction!r}: choose from {', '.join(REDUCTIONS)}")
    return Normalization(_OBJECTIVE_DENOMINATOR[reduction], True, constant, 1, count_empty)


def mistakes(right: Normalization, gas: int = 1, steps: int = 1) -> list[Normalization]:
    """Every normalization the checker replays against a failing loop: each denominator, with and
    without the world-size factor, with and without the constant, divided by GAS or not, either
    sequence convention; the right one excluded."""
    out = []
    for name in DENOMINATORS:
        if name == "tokens so far" and steps < 2:
            continue
        for times_world in (True, False):
            for constant in {right.constant, 1.0}:
                for g in {1, gas}:
                    for count_empty in (False, True):
                        per_seq = (
                            name in ("sequences", "rank sequences")
                            or DENOMINATORS[name].per_sequence
                        )
                        if count_empty and not per_seq:
                            continue  # the convention changes nothing here
                        n = Normalization(name, times_world, constant, g, count_empty)
                        if n != right and n not in out:
                            out.append(n)
    return out


def differences(got: Normalization, right: Normalization) -> list[str]:
    """What ``got`` does differently from ``right``, in a learner's words."""
    out = []
    if got.denominator != right.denominator:
        out.append(
            f"divides each micro-batch's summed loss by {DENOMINATORS[got.denominator].words}, "
            f"where the objective divides by {DENOMINATORS[right.denominator].words}"
        )
    if got.count_empty != right.count_empty:
        out.append(
            "counts sequences with no label as sequences"
            if got.count_empty
            else "does not count sequences with no label (the objective does)"
        )
    if got.times_world != right.times_world:
        out.append(
            "does not multiply by the world size W (the engine averages the ranks' gradients, "
            "so each rank's share of one global sum needs the factor W)"
            if right.times_world
            else "multiplies by the world size, which the objective does not"
        )
    if got.constant != right.constant:
        out.append(
            f"does not divide by the constant {right.constant:g}"
            if got.constant == 1.0
            else f"divides by the constant {got.constant:g}"
        )
    if got.gas != right.gas:
        out.append(
            f"is divided by gradient_accumulation_steps ({got.gas}): engine.backward(loss) does "
            "that unless scale_wrt_gas=False, also in unmanaged mode"
        )
    return out
