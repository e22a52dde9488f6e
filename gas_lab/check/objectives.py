"""What a step's loss should be, and the ways real loops get it wrong, as weights per target.

Every objective the checker knows is linear in the per-target cross-entropies: the step's
objective is ``sum(weight * cross_entropy)`` over every target of every micro-batch of every rank.
An objective is therefore a function ``weights(ranks)`` (``ranks[r]`` is rank r's list of
micro-batches) that returns the same nesting of ``[B, T]`` tensors, laid out as ``labels``: the
weight of the target ``labels[b, t]`` (a position that is not a target weighs nothing). A user's
``--objective FILE.py:FUNCTION`` is such a function, and so is each built-in reduction
(:data:`REDUCTIONS`, :func:`reduction`).

A loop makes its own micro-batch loss ``sum(loop_weight * cross_entropy)`` on each rank, and the
engine averages the ranks' gradients, so the step the loop takes follows ``loop_weight / W``. A
:class:`Normalization` is a recipe for a loop's weights: what each micro-batch's summed loss is
divided by (its :class:`Denominator`), times the world size W (or 1, or a hard-coded 2), divided
by a constant and by ``gradient_accumulation_steps`` or not. Every recipe is a way a loop can
weigh its tokens; :mod:`gas_lab.check.mistakes` lists them and :mod:`gas_lab.check.diagnosis`
replays them to name the one a wrong loop took.

The built-in reductions (``--reduction``):

* ``token``: the mean cross-entropy over every target of the step, on every rank (Hugging
  Face's ``num_items_in_batch``, verl's token-mean).
* ``sequence``: the mean, over sequences, of each sequence's own token mean (verl's
  seq-mean-token-mean). A sequence is a document: a packed row holds several, each starting
  where ``position_ids`` restarts at 0.
* ``microbatch-mean``: each micro-batch's own token mean, averaged over every micro-batch of
  every rank (what DeepSpeed's managed mode computes from a per-micro-batch mean loss, and a
  transformers model's ``out.loss`` without ``num_items_in_batch``).
* ``sum``: the total.
* ``token-sum/sequences``: the total divided by the number of sequences (verl's
  seq-mean-token-sum, TRL's Dr. GRPO).

A sequence (or, for ``microbatch-mean``, a micro-batch) with no target is not counted, unless
``count_empty`` (the convention verl's PR #4510 wrote, later reverted by PR #4769): then it
counts, with a mean of 0. ``constant`` divides any
objective by a fixed number (Dr. GRPO's maximum length).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE = -100  # Hugging Face's label for "no target here"
REDUCTIONS = ("token", "sequence", "microbatch-mean", "sum", "token-sum/sequences")

Weights = list[list[torch.Tensor]]  # weights[r][m]: [B, T], rank r's micro-batch m


@dataclass(frozen=True)
class Step:
    """One optimizer step's data: ``ranks[r]`` is rank r's list of micro-batches (dicts with
    ``input_ids``, ``labels``, ``attention_mask``, ``position_ids``, ``loss_mask``); ``before``
    is the target count of the earlier steps of the same run (for the mistake of carrying a
    count over)."""

    ranks: tuple[tuple[dict, ...], ...]
    before: int = 0

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def every(self) -> list[dict]:
        return [mb for rank in self.ranks for mb in rank]


# -- what a micro-batch holds, per position -----------------------------------------------------
def targets(mb: dict) -> torch.Tensor:
    """1.0 where ``labels`` has a target that counts, 0.0 elsewhere, [B, T] (the ``loss_mask``:
    under transformers' convention it already leaves out what the model's shift drops)."""
    return mb["loss_mask"].float()


def documents(mb: dict) -> torch.Tensor:
    """[B, T, D]: 1.0 where position t of row b belongs to the row's document d. A document
    starts where ``position_ids`` is 0 on an attended position (a packed row holds several)."""
    attended = mb["attention_mask"] > 0
    starts = (mb["position_ids"] == 0) & attended
    index = starts.long().cumsum(1) - 1
    count = int(starts.sum(1).max().item()) if starts.numel() else 0
    if count == 0:
        return torch.zeros(*index.shape, 1)
    onehot = F.one_hot(index.clamp(min=0), count).float()
    return onehot * (attended & (index >= 0)).unsqueeze(-1).float()


def _per_document(mb: dict, per_doc: torch.Tensor) -> torch.Tensor:
    """A value per document [B, D] spread back onto its positions, [B, T]."""
    return (documents(mb) * per_doc.unsqueeze(1)).sum(-1)


def document_targets(mb: dict) -> torch.Tensor:
    """Targets per document, [B, D]."""
    return (documents(mb) * targets(mb).unsqueeze(-1)).sum(1)


def document_count(mb: dict, count_empty: bool) -> float:
    """The micro-batch's documents (those with a target, or all of them if ``count_empty``)."""
    docs = documents(mb)
    exists = docs.sum(1) > 0
    if not count_empty:
        exists &= document_targets(mb) > 0
    return float(exists.sum())


def completion_span(mb: dict) -> torch.Tensor:
    """Per document, [B, D]: positions from its first target to its last, inclusive (unlabelled
    positions inside included): what a loop gets when it counts a completion's length."""
    docs = documents(mb)
    t = torch.arange(docs.shape[1], dtype=torch.float).view(1, -1, 1)
    marked = docs * targets(mb).unsqueeze(-1)
    last = (marked * t).amax(1)
    first = torch.where(marked > 0, t.expand_as(marked), torch.inf).amin(1)
    return torch.where(marked.sum(1) > 0, last - first + 1, torch.zeros_like(last))


def row_count(mb: dict, count_empty: bool) -> float:
    rows = mb["attention_mask"].sum(1) > 0
    if not count_empty:
        rows &= targets(mb).sum(1) > 0
    return float(rows.sum())


def micro_batch_count(mbs, count_empty: bool) -> float:
    return float(sum(1 for mb in mbs if count_empty or targets(mb).sum() > 0))


# -- denominators: what a loop divides each micro-batch's summed loss by ------------------------
# Each is a function (step, rank r, micro-batch m, count_empty) -> a number or a [B, T] tensor
# (a divisor per position, for those that divide each token by its own sequence's count).
Divisor = Callable[[Step, int, int, bool], "torch.Tensor | float"]


def _sum(values) -> float:
    return float(sum(float(v) for v in values))


@dataclass(frozen=True)
class Denominator:
    name: str
    words: str  # for a learner: "divides each micro-batch's summed loss by <words>"
    divisor: Divisor
    counts: str = ""  # "sequences" or "micro-batches": what the empty-sequence convention counts


def _mb(step, r, m):
    return step.ranks[r][m]


DENOMINATORS = {
    d.name: d
    for d in (
        Denominator("one", "nothing", lambda s, r, m, e: 1.0),
        Denominator("tokens", "every rank's labelled tokens",
                    lambda s, r, m, e: _sum(targets(x).sum() for x in s.every())),
        Denominator("tokens so far", "every rank's labelled tokens of this step and the steps before it",
                    lambda s, r, m, e: _sum(targets(x).sum() for x in s.every()) + s.before),
        Denominator("rank tokens", "this rank's own labelled tokens",
                    lambda s, r, m, e: _sum(targets(x).sum() for x in s.ranks[r])),
        Denominator("attended", "every rank's attended positions (attention_mask), prompt and all",
                    lambda s, r, m, e: _sum(x["attention_mask"].sum() for x in s.every())),
        Denominator("rank attended", "this rank's own attended positions (attention_mask)",
                    lambda s, r, m, e: _sum(x["attention_mask"].sum() for x in s.ranks[r])),
        Denominator("positions", "every rank's padded positions (B x T of each micro-batch)",
                    lambda s, r, m, e: _sum(x["labels"].numel() for x in s.every())),
        Denominator("completion positions",
                    "every rank's completion lengths (first labelled position to last, the "
                    "unlabelled positions inside included), not its labelled tokens",
                    lambda s, r, m, e: _sum(completion_span(x).sum() for x in s.every())),
        Denominator("tokens, empty sequence as one",
                    "every rank's labelled tokens, a sequence with none counted as one token",
                    lambda s, r, m, e: _sum(document_targets(x).clamp(min=1)[documents(x).sum(1) > 0].sum()
                                            for x in s.every())),
        Denominator("tokens, empty micro-batch as one",
                    "every rank's labelled tokens, a micro-batch with none counted as one token",
                    lambda s, r, m, e: _sum(targets(x).sum().clamp(min=1) for x in s.every())),
        Denominator("micro-batch tokens", "the micro-batch's own labelled tokens (a sum of micro-batch means)",
                    lambda s, r, m, e: float(targets(_mb(s, r, m)).sum())),
        Denominator("micro-batch tokens x rank micro-batches",
                    "the micro-batch's own labelled tokens and this rank's number of micro-batches "
                    "(a mean of micro-batch means)",
                    lambda s, r, m, e: float(targets(_mb(s, r, m)).sum()) * micro_batch_count(s.ranks[r], e),
                    "micro-batches"),
        Denominator("micro-batch tokens x micro-batches",
                    "the micro-batch's own labelled tokens and every rank's number of micro-batches "
                    "(a mean of micro-batch means over all ranks)",
                    lambda s, r, m, e: float(targets(_mb(s, r, m)).sum()) * micro_batch_count(s.every(), e),
                    "micro-batches"),
        Denominator("sequences", "every rank's number of sequences",
                    lambda s, r, m, e: _sum(document_count(x, e) for x in s.every()), "sequences"),
        Denominator("rank sequences", "this rank's own number of sequences",
                    lambda s, r, m, e: _sum(document_count(x, e) for x in s.ranks[r]), "sequences"),
        Denominator("sequences x width",
                    "every rank's number of sequences times the micro-batch's padded length T "
                    "(the tensor's width, not a fixed maximum length)",
                    lambda s, r, m, e: _sum(document_count(x, e) for x in s.every())
                    * _mb(s, r, m)["labels"].shape[1], "sequences"),
        Denominator("rows", "every rank's number of rows (a packed row counted as one sequence)",
                    lambda s, r, m, e: _sum(row_count(x, e) for x in s.every()), "sequences"),
        Denominator("sequence means", "every rank's number of sequences, each token by its sequence's tokens",
                    lambda s, r, m, e: _sum(document_count(x, e) for x in s.every())
                    * _per_document(_mb(s, r, m), document_targets(_mb(s, r, m))), "sequences"),
        Denominator("rank sequence means",
                    "this rank's own number of sequences, each token by its sequence's tokens",
                    lambda s, r, m, e: _sum(document_count(x, e) for x in s.ranks[r])
                    * _per_document(_mb(s, r, m), document_targets(_mb(s, r, m))), "sequences"),
        Denominator("row means",
                    "every rank's number of rows, each token by its row's tokens (a packed row "
                    "counted as one sequence)",
                    lambda s, r, m, e: _sum(row_count(x, e) for x in s.every())
                    * targets(_mb(s, r, m)).sum(1, keepdim=True), "sequences"),
        Denominator("completion-length sequence means",
                    "every rank's number of sequences, each token by its sequence's completion "
                    "length (the unlabelled positions inside included), not its labelled tokens",
                    lambda s, r, m, e: _sum(document_count(x, e) for x in s.every())
                    * _per_document(_mb(s, r, m), completion_span(_mb(s, r, m))), "sequences"),
    )
}  # fmt: skip

# The built-in reductions, each as what it divides every target's cross-entropy by.
REDUCTION_DENOMINATOR = {
    "token": "tokens",
    "sequence": "sequence means",
    "microbatch-mean": "micro-batch tokens x micro-batches",
    "sum": "one",
    "token-sum/sequences": "sequences",
}


@dataclass(frozen=True)
class Normalization:
    """How a loop turns a micro-batch's target cross-entropies into the loss it backpropagates
    (a recipe for its weights)."""

    denominator: str
    factor: int | str = "W"  # what the loss is multiplied by: "W" (the world size) or a number
    constant: float = 1.0  # divided by this too
    gas: int = 1  # divided by this too (backward()'s scale_wrt_gas with GAS > 1)
    count_empty: bool = False  # a sequence (micro-batch) without targets counts as one

    def multiplier(self, world_size: int) -> float:
        return float(world_size if self.factor == "W" else self.factor)

    def loop_weights(self, step: Step) -> Weights:
        """Per-target weight of every micro-batch of every rank, as the loop's loss has it."""
        divisor = DENOMINATORS[self.denominator].divisor
        scale = self.multiplier(step.world_size) / (self.constant * self.gas)
        out = []
        for r, mbs in enumerate(step.ranks):
            row = []
            for m, mb in enumerate(mbs):
                den = torch.as_tensor(divisor(step, r, m, self.count_empty), dtype=torch.float)
                on = targets(mb)
                # a count of 0 where there is no target weighs nothing (loops clamp it)
                safe = torch.where(den > 0, den, torch.ones_like(den))
                row.append(on * scale / safe * (den > 0))
            out.append(row)
        return out

    def weights(self, step: Step, averaged: bool = True) -> Weights:
        """What the step follows when every rank backpropagates the loop's loss: the loop's
        weights over W, the engine averaging the ranks' gradients (or as they are, summing)."""
        w = step.world_size if averaged else 1
        return [[x / w for x in row] for row in self.loop_weights(step)]


def reduction(name: str, constant: float = 1.0, count_empty: bool = False) -> Normalization:
    """The built-in reduction ``name`` as the recipe of a loop that computes it exactly: its
    weights (averaged over W by the engine) are the objective's."""
    if name not in REDUCTIONS:
        raise ValueError(f"reduction {name!r}: choose from {', '.join(REDUCTIONS)}")
    counts = DENOMINATORS[REDUCTION_DENOMINATOR[name]].counts
    return Normalization(
        REDUCTION_DENOMINATOR[name], "W", constant, 1, count_empty and bool(counts)
    )


@dataclass(frozen=True)
class Objective:
    """What the user declared: a built-in reduction, or their own ``weights(ranks)`` function;
    divided by ``constant``."""

    name: str  # the reduction, or the user's FILE.py:FUNCTION (or the function's name)
    function: Callable | None = None  # a user's FUNCTION(ranks) -> weights; None: built-in
    constant: float = 1.0
    count_empty: bool = False

    @property
    def builtin(self) -> bool:
        return self.function is None

    @property
    def recipe(self) -> Normalization | None:
        """The built-in's recipe for a loop on an averaging engine; None for a user's."""
        return reduction(self.name, self.constant, self.count_empty) if self.builtin else None

    def weights(self, step: Step) -> Weights:
        """Per-target weights of the whole step: the objective is sum(weight * cross_entropy)."""
        if self.builtin:
            return self.recipe.weights(step)
        ranks = [[dict(mb) for mb in mbs] for mbs in step.ranks]
        got = self.function(ranks)
        check_weights(got, step, self.name)
        return [[torch.as_tensor(x).float() / self.constant for x in row] for row in got]


def check_weights(got, step: Step, name: str) -> None:
    """ValueError naming what is wrong with a user's weights: their nesting, shapes, values."""
    where = f"objective {name}"
    if not isinstance(got, (list, tuple)) or len(got) != step.world_size:
        raise ValueError(
            f"{where}: returned {type(got).__name__}"
            + (f" of {len(got)}" if isinstance(got, (list, tuple)) else "")
            + f"; want a list of {step.world_size} ranks, each a list of [B, T] tensors"
        )
    for r, (row, mbs) in enumerate(zip(got, step.ranks, strict=True)):
        if not isinstance(row, (list, tuple)) or len(row) != len(mbs):
            raise ValueError(
                f"{where}: rank {r} has {len(mbs)} micro-batches, the weights "
                f"{len(row) if isinstance(row, (list, tuple)) else type(row).__name__}"
            )
        for m, (w, mb) in enumerate(zip(row, mbs, strict=True)):
            shape = tuple(mb["labels"].shape)
            if not torch.is_tensor(w) or tuple(w.shape) != shape:
                got_shape = list(w.shape) if torch.is_tensor(w) else type(w).__name__
                raise ValueError(
                    f"{where}: rank {r}, micro-batch {m}: weights {got_shape}, want the "
                    f"labels' shape {list(shape)}"
                )
            if not torch.isfinite(w).all():
                raise ValueError(f"{where}: rank {r}, micro-batch {m}: weights not finite")
