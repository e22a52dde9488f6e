"""The cases the checker runs a loop on: 2 ranks, micro-batches in Hugging Face's convention.

Each case is written down as labelled tokens per sequence: ``((1, 5), (6, 2))`` is a rank with
two micro-batches of two sequences, the first with 1 and 5 labelled tokens. The counts are
chosen so that wrong normalizations cannot pass by coincidence: within a step no two
micro-batches and no two ranks hold the same number of labelled tokens, sequences differ in
length, prompts (attended, not labelled) differ in length too, and one rank holds more
sequences than the other where both run as many micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gas_lab.check.objectives import IGNORE, Step

WORLD_SIZE = 2
VOCAB, LENGTH = 16, 10  # the model's vocabulary; positions per sequence (prompt + labels + padding)


@dataclass(frozen=True)
class Case:
    name: str
    words: str  # what the case is there to catch
    steps: tuple  # steps[s][rank] = that rank's micro-batches, each a tuple of labelled tokens

    @property
    def equal_counts(self) -> bool:
        return all(len({len(mbs) for mbs in step}) == 1 for step in self.steps)

    def counts(self) -> list[list[int]]:
        """Micro-batches per rank, per step."""
        return [[len(mbs) for mbs in step] for step in self.steps]

    def describe(self) -> str:
        """``step 1: rank 0 runs 3 micro-batches (5, 8, 9 labelled tokens); rank 1 ...``"""
        out = []
        for s, step in enumerate(self.steps):
            ranks = []
            for r, mbs in enumerate(step):
                tokens = ", ".join(str(sum(mb)) for mb in mbs)
                ranks.append(
                    f"rank {r} runs {len(mbs)} micro-batch{'es' if len(mbs) != 1 else ''}"
                    + (f" ({tokens} labelled tokens)" if mbs else "")
                )
            out.append(("" if len(self.steps) == 1 else f"step {s + 1}: ") + "; ".join(ranks))
        return " | ".join(out)

    def data(self, seed: int = 0) -> list[Step]:
        """The case's micro-batches, the same in every process that asks."""
        out, before = [], 0
        for s, step in enumerate(self.steps):
            ranks = tuple(
                tuple(micro_batch(mb, seed, s, r, m) for m, mb in enumerate(mbs))
                for r, mbs in enumerate(step)
            )
            out.append(Step(ranks, before))
            before += sum(sum(mb) for mbs in step for mb in mbs)
        return out


def micro_batch(tokens: tuple[int, ...], seed: int, step: int, rank: int, micro: int) -> dict:
    """One micro-batch: a sequence per entry of ``tokens``, each a prompt of 1-3 positions
    (attended, label -100), then that many labelled positions, then padding (token 0, not
    attended, label -100). ``labels[b, t]`` is the target of ``logits[b, t]``."""
    g = torch.Generator().manual_seed((((seed * 100 + step) * 100 + rank) * 100) + micro)
    ids = torch.randint(1, VOCAB, (len(tokens), LENGTH), generator=g)
    targets = torch.randint(0, VOCAB, (len(tokens), LENGTH), generator=g)
    labels = torch.full_like(ids, IGNORE)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(tokens):
        prompt = 1 + (b + n + micro) % 3
        if prompt + n > LENGTH:
            raise ValueError(f"{n} labelled tokens do not fit in {LENGTH} positions")
        mask[b, : prompt + n] = 1
        labels[b, prompt : prompt + n] = targets[b, prompt : prompt + n]
    return {"input_ids": ids * mask, "labels": labels, "attention_mask": mask}


CASES = (
    Case("equal", "every rank runs the same number of micro-batches (not of sequences)",
         ((((1, 5), (6, 2)), ((3, 7, 2), (4, 1))),)),
    Case("unequal", "ranks run different numbers of micro-batches (3 and 1)",
         ((((2, 3), (7, 1), (4, 5)), ((6, 7),)),)),
    Case("empty sequences", "sequences with no label left",
         ((((0, 6), (3, 0)), ((5, 2), (0, 4))),)),
    Case("idle rank", "one rank has no micro-batch at all",
         (((), ((2, 6), (5, 4))),)),
    Case("two steps", "two steps in a row: nothing may carry over",
         ((((3, 4), (6, 5)), ((2, 7), (1, 2))), (((4, 2), (7, 3)), ((1, 4), (6, 6))))),
)  # fmt: skip
BY_NAME = {c.name: c for c in CASES}


def chosen(equal_counts: bool = False) -> list[Case]:
    """The cases to run: all of them, or (``--equal-counts``) those where every rank runs the
    same number of micro-batches, for trainers that guarantee it."""
    return [c for c in CASES if c.equal_counts or not equal_counts]
