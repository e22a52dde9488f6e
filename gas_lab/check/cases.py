"""The cases the checker runs a loop on: micro-batches as trainers carry them, on W ranks.

Each case is written down as labelled tokens per row, for up to 4 ranks (a run on W ranks takes
the first W): ``((1, 5), (6, 2))`` is a rank with two micro-batches of two rows, the first with
1 and 5 labelled tokens. A row can also be :func:`holes` (a completion with unlabelled positions
inside it: tool output, earlier turns) or :func:`packed` (several documents in one row,
``position_ids`` restarting at each). The counts are chosen so that wrong normalizations cannot
pass by coincidence: within a step no two micro-batches and no two ranks hold the same number of
labelled tokens, sequences differ in length, prompts (attended, not labelled) differ in length
too, and one rank holds more sequences than another where both run as many micro-batches. Each
case after the first five is where one known mistake hides from every other case
(``tests/test_check.py`` proves it from the data).

A micro-batch is a dict of ``[B, T]`` tensors: ``input_ids``, ``labels`` (-100: no target),
``attention_mask``, ``position_ids`` and ``loss_mask`` (1 exactly where ``labels`` has a
target). With the toy model (``convention="toy"``) ``labels[b, t]`` is the target of
``logits[b, t]``; with transformers' (``"hf"``) labels are the input ids, and the model shifts
them (``logits[b, t - 1]`` predicts ``labels[b, t]``): no target sits at position 0, so every
target counts after the shift.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gas_lab.check.objectives import IGNORE, Step

WORLD_SIZE = 2  # the default; cases are written for up to MAX_WORLD_SIZE ranks
MAX_WORLD_SIZE = 4
VOCAB, LENGTH = 16, 10  # the model's vocabulary; positions per row (prompt + labels + padding)
CONVENTIONS = ("toy", "hf")


@dataclass(frozen=True)
class Doc:
    """One document's completion: alternately labelled and unlabelled positions, (3, 2, 1) is 3
    labelled, 2 not (attended: tool output, an earlier turn), 1 labelled."""

    segments: tuple[int, ...]

    @property
    def labelled(self) -> int:
        return sum(self.segments[::2])

    @property
    def length(self) -> int:
        return sum(self.segments)


@dataclass(frozen=True)
class Packed:
    """Several documents in one row."""

    docs: tuple[Doc, ...]


def holes(*segments: int) -> Doc:
    """A completion with unlabelled positions inside it: labelled, hole, labelled, ..."""
    return Doc(tuple(segments))


def packed(*docs: int | Doc) -> Packed:
    """A row of 2-3 documents, ``position_ids`` restarting at each."""
    return Packed(tuple(_doc(d) for d in docs))


def _doc(d: int | Doc) -> Doc:
    return d if isinstance(d, Doc) else Doc((d,))


def _docs(row) -> tuple[Doc, ...]:
    return row.docs if isinstance(row, Packed) else (_doc(row),)


def labelled(row) -> int:
    return sum(d.labelled for d in _docs(row))


@dataclass(frozen=True)
class Case:
    name: str
    words: str  # what the case is there to catch
    steps: tuple  # steps[s][rank] = that rank's micro-batches, each a tuple of rows
    padding: str = "max"  # "max": every row to LENGTH; "longest": each micro-batch to its longest

    def ranks(self, world_size: int = WORLD_SIZE) -> tuple:
        """The steps on ``world_size`` ranks: the first ``world_size`` ranks of each."""
        return tuple(step[:world_size] for step in self.steps)

    def equal_counts_at(self, world_size: int = WORLD_SIZE) -> bool:
        return all(len({len(mbs) for mbs in step}) == 1 for step in self.ranks(world_size))

    @property
    def equal_counts(self) -> bool:
        return self.equal_counts_at(WORLD_SIZE)

    def counts(self, world_size: int = WORLD_SIZE) -> list[list[int]]:
        """Micro-batches per rank, per step."""
        return [[len(mbs) for mbs in step] for step in self.ranks(world_size)]

    def describe(self, world_size: int = WORLD_SIZE) -> str:
        """``step 1: rank 0 runs 3 micro-batches (5, 8, 9 labelled tokens); rank 1 ...``"""
        out = []
        for s, step in enumerate(self.ranks(world_size)):
            ranks = []
            for r, mbs in enumerate(step):
                tokens = ", ".join(str(sum(labelled(row) for row in mb)) for mb in mbs)
                ranks.append(
                    f"rank {r} runs {len(mbs)} micro-batch{'es' if len(mbs) != 1 else ''}"
                    + (f" ({tokens} labelled tokens)" if mbs else "")
                )
            out.append(("" if len(self.steps) == 1 else f"step {s + 1}: ") + "; ".join(ranks))
        return " | ".join(out) + (f" ({self.words})" if self.name in NEW else "")

    def data(
        self, seed: int = 0, world_size: int = WORLD_SIZE, convention: str = "toy"
    ) -> list[Step]:
        """The case's micro-batches, the same in every process that asks."""
        out, before = [], 0
        for s, step in enumerate(self.ranks(world_size)):
            ranks = tuple(
                tuple(
                    micro_batch(mb, seed, s, r, m, self.padding, convention)
                    for m, mb in enumerate(mbs)
                )
                for r, mbs in enumerate(step)
            )
            out.append(Step(ranks, before))
            before += sum(labelled(row) for mbs in step for mb in mbs for row in mb)
        return out


def micro_batch(
    rows: tuple,
    seed: int,
    step: int,
    rank: int,
    micro: int,
    padding: str = "max",
    convention: str = "toy",
) -> dict:
    """One micro-batch: per row, each document a prompt of 1-3 positions (attended, label -100)
    then its completion (labelled, with any holes), then padding (token 0, not attended, label
    -100). ``position_ids`` count from 0 in each document."""
    g = torch.Generator().manual_seed((((seed * 100 + step) * 100 + rank) * 100) + micro)
    ids = torch.randint(1, VOCAB, (len(rows), LENGTH), generator=g)
    drawn = torch.randint(0, VOCAB, (len(rows), LENGTH), generator=g)
    target = torch.zeros_like(ids, dtype=torch.bool)
    mask = torch.zeros_like(ids)
    positions = torch.zeros_like(ids)
    used = []
    for b, row in enumerate(rows):
        t = 0
        for d, doc in enumerate(_docs(row)):
            if isinstance(row, Packed):
                prompt = 1 + (b + d) % 2
            else:
                prompt = 1 + (b + doc.length + micro) % 3
            end = t + prompt + doc.length
            if end > LENGTH:
                raise ValueError(f"row {row} does not fit in {LENGTH} positions")
            mask[b, t:end] = 1
            positions[b, t:end] = torch.arange(end - t)
            c = t + prompt
            for k, seg in enumerate(doc.segments):
                target[b, c : c + seg] = k % 2 == 0
                c += seg
            t = end
        positions[b, t:] = torch.arange(LENGTH - t) + (positions[b, t - 1] + 1 if t else 0)
        used.append(t)
    ids = ids * mask
    labels = torch.where(target, ids if convention == "hf" else drawn, torch.full_like(ids, IGNORE))
    out = {
        "input_ids": ids,
        "labels": labels,
        "attention_mask": mask,
        "position_ids": positions,
        "loss_mask": target.long(),
    }
    if padding == "longest":
        width = max(used)
        out = {k: v[:, :width].contiguous() for k, v in out.items()}
    return out


CASES = (
    Case("equal", "every rank runs the same number of micro-batches (not of sequences)",
         ((((1, 5), (6, 2)), ((3, 7, 2), (4, 1)), ((2, 1, 1), (7, 2)), ((3, 4, 3), (1, 1))),)),
    Case("unequal", "ranks run different numbers of micro-batches",
         ((((2, 3), (7, 1), (4, 5)), ((6, 7),), ((1, 1), (3,)), ((4, 6, 2), (6, 4), (1,))),)),
    Case("empty sequences", "sequences with no label left",
         ((((0, 6), (3, 0)), ((5, 2), (0, 4)), ((0, 1, 7), (2, 0)), ((0, 5, 0), (1, 0, 0))),)),
    Case("idle rank", "one rank has no micro-batch at all",
         (((), ((2, 6), (5, 4)), ((3, 1),), ((7,), (1, 5), (2,))),)),
    Case("two steps", "two steps in a row: nothing may carry over",
         ((((3, 4), (6, 5)), ((2, 7), (1, 2)), ((1, 1), (2, 2)), ((5,), (7, 1))),
          (((4, 2), (7, 3)), ((1, 4), (6, 6)), ((3,), (1, 1)), ((7, 2), (4,))))),
    Case("holes", "unlabelled positions (-100) inside attended completions: tool output, earlier turns",
         ((((holes(2, 2, 3), 4), (5, holes(1, 3, 2))),
           ((holes(3, 1, 2), 2, holes(2, 2, 1)), (6,)),
           ((holes(1, 4, 1),), (3, holes(2, 1, 2))),
           ((holes(3, 3, 1),), (holes(2, 1, 1, 1, 1), 7))),)),
    Case("empty micro-batch", "a micro-batch whose labels are all -100",
         ((((3, 5), (0, 0)), ((2,), (6, 4)), ((1, 5), (7,)), ((3,), (2, 1, 1))),)),
    Case("packed", "packed rows: 2-3 documents per row, position_ids restarting at each",
         ((((packed(2, 3), 4), (packed(1, 1, 2),)),
           ((packed(3, 1), packed(2, 2)), (6, packed(1, 3))),
           ((packed(2, 1, 2),), (2, packed(4, 1))),
           ((packed(3, 3), 5), (packed(1, 2),))),)),
    Case("lengths", "micro-batches of different lengths T, each padded to its own longest row",
         ((((1, 2), (6, 3, 5)), ((4,), (2, 7)), ((5, 1), (2,)), ((7,), (1, 3, 1))),),
         padding="longest"),
)  # fmt: skip
BY_NAME = {c.name: c for c in CASES}
NEW = ("holes", "empty micro-batch", "packed", "lengths")  # issue 35: where bugs still hid


def chosen(equal_counts: bool = False, world_size: int = WORLD_SIZE) -> list[Case]:
    """The cases to run: all of them, or (``--equal-counts``) those where every rank runs the
    same number of micro-batches, for trainers that guarantee it."""
    return [c for c in CASES if c.equal_counts_at(world_size) or not equal_counts]
